"""``python -m bench overload`` on a tiny setting, so that it cannot rot, and its share of the
offered rate per client."""

from __future__ import annotations

import pytest

from bench.load.hey import HEY_INSTALL_HINT, have_hey
from bench.suites.overload import per_client_rate
from tests.bench.suiterun import SuiteRun
from tests.serverproc import free_ports


def test_each_client_gets_its_share_of_the_offered_rate_rounded_up() -> None:
    assert per_client_rate(1000.0, 3.0, 1500) == 2.0
    assert per_client_rate(1001.0, 3.0, 1500) == 2.01
    assert per_client_rate(1.0, 3.0, 1500) == 0.01


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
