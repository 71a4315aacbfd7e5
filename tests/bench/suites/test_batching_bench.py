"""The batching benches' verdict: auto against the best fixed timeout's p99."""

from __future__ import annotations

from bench.suites.batching import render


def _run(policy: str, p99: float, rps: float) -> dict[str, object]:
    return {
        "policy": policy,
        "fraction": 0.6,
        "repeat": 0,
        "p50_ms": p99 / 2,
        "p99_ms": p99,
        "rps": rps,
        "mean_batch_rows": 4.0,
    }


def test_the_open_loop_report_judges_auto_against_the_best_fixed_p99() -> None:
    plan = {
        "capacity_clients": 64,
        "seconds": 10,
        "warmup_s": 2,
        "repeats": 1,
        "fractions": [0.6],
        "policies": ["0", "5", "auto"],
    }
    results = {"bench": "openloop", "plan": plan, "capacity": {"auto": 100.0}}
    within = render(
        {**results, "runs": [_run("0", 50, 60), _run("5", 40, 60), _run("auto", 43, 60)]}
    )
    assert "108% of the best fixed (5 ms, 40.0 ms)" in within and "within the bar" in within
    worse = render(
        {**results, "runs": [_run("0", 50, 60), _run("5", 40, 60), _run("auto", 45, 60)]}
    )
    assert "NOT within the bar" in worse
