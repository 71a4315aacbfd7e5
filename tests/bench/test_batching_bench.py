"""The batching benches' pure parts: Poisson arrivals and the open-loop verdict."""

from __future__ import annotations

import numpy as np

from bench.load.pyload import arrivals
from bench.suites.batching import render


def test_poisson_arrivals_keep_the_mean_rate_and_vary_the_gaps() -> None:
    due = arrivals(200.0, 30.0, poisson=True)
    assert abs(len(due) / 30.0 - 200.0) < 10
    gaps = np.diff(due)
    assert (gaps >= 0).all() and 0.8 < gaps.std() / gaps.mean() < 1.2  # exponential: cv 1
    assert np.array_equal(arrivals(10.0, 1.0, poisson=False), np.arange(10) / 10.0)


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
