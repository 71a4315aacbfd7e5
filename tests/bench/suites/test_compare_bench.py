"""The benchmark harness on a tiny setting, so that it cannot rot: light model, one system, ~1 s
of load. The shardserve server joins the session's Ray instead of starting a second one."""

from __future__ import annotations

from bench.suites.compare.report import ANALYSIS_MARKER, medians, render
from tests.bench.suiterun import SuiteRun
from tests.serverproc import free_ports


def _record(system: str, scenario: str, rps: float) -> dict[str, object]:
    return {
        "workload": "light",
        "system": system,
        "repeat": 0,
        "scenario": scenario,
        "rps": rps,
        "p50_ms": 2.0,
        "p99_ms": 9.0,
        "errors": 0,
        "frontend": {"rss_mb": 100.0, "tensorflow_loaded": False},
        "mean_batch_rows": 32.0 if system.startswith("shardserve") else None,
        "frontend_ms_per_request": 0.5,
        "workers_ms_per_row": 1.2,
        "ray_ms_per_request": 0.05,
        "idle_share": 0.1,
    }


def _results() -> dict[str, object]:
    return {
        "plan": {
            "workloads": ["light"],
            "repeats": 2,
            "seconds": 1.0,
            "max_batch_size": 8,
            "batch_timeout_ms": 5.0,
        },
        "ceiling": {
            "light": {"64": {"ms": 1.0, "rows_per_s": 4000.0, "calls": 10, "cpu_ms_per_row": 0.7}}
        },
        "runs": [
            _record("shardserve-1", "c64", 1000.0),
            _record("shardserve-1", "c64", 3000.0),
            _record("litserve", "c64", 1000.0),
        ],
        "overlap": [],
    }


def test_medians_are_taken_over_repeats() -> None:
    med = medians(_results()["runs"])  # type: ignore[arg-type]
    assert med[("light", "shardserve-1", "c64")]["rps"] == 2000.0
    assert med[("light", "shardserve-1", "c64")]["n"] == 2


def test_report_gives_ratios_and_keeps_the_hand_written_analysis() -> None:
    old = f"# old numbers\n{ANALYSIS_MARKER}\n## Why\nkept text\n"
    text = render(_results(), "python -m bench run --tiny", old)
    assert "| shardserve-1 | 2.00x | 0.50x |" in text  # / litserve, / ceiling
    assert "`python -m bench run --tiny`" in text
    assert "| shardserve-1 | c64 | 32.0 | 0.500 | 1.200 | 0.700 | 0.050 | 10% |" in text
    assert "| litserve | c64 | - | 0.500 | 1.200 | 0.700 | 0.050 | 10% |" in text
    assert text.endswith(f"{ANALYSIS_MARKER}\n## Why\nkept text\n")
    assert "# old numbers" not in text


def test_harness_runs_end_to_end_on_a_tiny_setting(bench_on_session_ray: SuiteRun) -> None:
    args = ["--workloads", "light", "--systems", "shardserve-1", "--repeats", "1"]
    # No warm-up (wrk would run 1 s of it): the server warms its model before it is ready.
    args += ["--seconds", "1", "--warmup", "0", "--concurrency", "1,8", "--max-batch-size", "8"]
    # A free port, not a fixed one: another server on the machine must not fail the run.
    (port,) = free_ports(1)
    args += ["--open-rates", "light=20", "--overlap-stages", "", "--port", str(port)]
    results = bench_on_session_ray.run("run", *args, "--ceiling-seconds", "0.3")
    scenarios = {r["scenario"]: r for r in results["runs"]}
    assert set(scenarios) == {"c1", "c8", "open20"}
    for run in scenarios.values():
        assert run["errors"] == 0
        assert run["rps"] > 0
        # The signature comes from the bundle manifest: the HTTP process never loads TF.
        assert run["frontend"]["tensorflow_loaded"] is False
        assert run["mean_batch_rows"] >= 1 and run["frontend_ms_per_request"] > 0
    assert results["ceiling"]["light"]["64"]["rows_per_s"] > 0
    assert "| shardserve-1 |" in bench_on_session_ray.table("run")
    assert (bench_on_session_ray.out / "bench_throughput.png").stat().st_size > 0
