"""``python -m bench overload`` on a tiny setting, so that it cannot rot, its share of the
offered rate per client, and the access log's goodput against the log off from canned phases."""

from __future__ import annotations

import pytest

from bench.load.hey import HEY_INSTALL_HINT, have_hey
from bench.suites.overload import OverloadPlan, per_client_rate, render, summarize_access_log
from tests.bench.suiterun import SuiteRun
from tests.serverproc import free_ports


def test_each_client_gets_its_share_of_the_offered_rate_rounded_up() -> None:
    assert per_client_rate(1000.0, 3.0, 1500) == 2.0
    assert per_client_rate(1001.0, 3.0, 1500) == 2.01
    assert per_client_rate(1.0, 3.0, 1500) == 0.01


def _phase(form: str, round_: int, good: float) -> dict[str, object]:
    return {
        "phase": f"overload (access log {form})", "access_log": form, "round": round_,
        "answered_per_s": 3000.0, "good_per_s": good, "goodput_ratio": good / 1000.0,
        "reject_per_s": 3000.0 - good, "reject_p99_ms": 4.0, "good_p99_ms": 300.0,
        "cores": {"frontend": 0.9},
    }  # fmt: skip


def test_the_access_log_is_compared_with_the_log_off_on_median_goodput() -> None:
    phases = [_phase("off", 0, 900.0), _phase("json", 0, 880.0)]
    phases += [_phase("json", 1, 800.0), _phase("off", 1, 1000.0)]
    summary = summarize_access_log(phases, ("off", "json"))
    assert summary["median_good_per_s"] == {"off": 950.0, "json": 840.0}
    assert summary["ratio"]["json"] == pytest.approx(840.0 / 950.0)
    table = render(
        {"plan": {"factor": 3.0}, "capacity": 1000.0, "phases": phases, "access_log": summary}
    )
    assert "| json | 880, 800 | 840 | 0.884 | **missed** |" in table
    assert "| off | 900, 1,000 | 950 | 1.000 | - |" in table
    with pytest.raises(ValueError, match="distinct forms"):
        OverloadPlan(access_log=("off", "xml"))


@pytest.mark.skipif(not have_hey(), reason=f"hey is not installed; {HEY_INSTALL_HINT}")
def test_overload_bench_runs_on_a_tiny_setting(bench_on_session_ray: SuiteRun) -> None:
    (port,) = free_ports(1)
    # 1 s a phase: hey's shortest run (it rounds to whole seconds).
    args = ["--workload", "light", "--max-batch-size", "8", "--warmup", "1"]
    args += ["--capacity-clients", "8", "--capacity-seconds", "1", "--clients", "64"]
    args += ["--seconds", "1", "--staggered-groups", "4", "--retry-seconds", "1"]
    results = bench_on_session_ray.run("overload", *args, "--port", str(port))
    phases = {p["phase"]: p for p in results["phases"]}
    assert list(phases) == ["capacity", "overload", "overload, 4 staggered hey", "retry storm"]
    assert results["capacity"] > 0
    assert phases["capacity"]["goodput_ratio"] == pytest.approx(1.0)
    assert phases["overload"]["rate_per_client"] > 0
    for phase in phases.values():
        assert phase["good_per_s"] > 0
        assert phase["rss_after_mb"] > 0
        assert set(phase["statuses"]) <= {"200", "503"}
    assert "| target (overload phase) |" in bench_on_session_ray.table("overload")
