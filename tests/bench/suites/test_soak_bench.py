"""``python -m bench soak``'s verdict on canned RSS samples: a high-water mark that levels off is
flat, a climb all along is growing."""

from __future__ import annotations

import pytest

from bench.suites.soak import judge, render


def test_a_level_that_settles_early_is_flat() -> None:
    samples = [410.0, 420.0, 430.0, 431.0, 430.0, 431.0, 432.0, 431.0, 430.0, 431.0]
    verdict = judge(samples, elapsed_s=540.0, flat_mb=20.0)
    assert verdict["verdict"] == "flat"
    assert verdict["first_mb"] == 415.0 and verdict["last_mb"] == 430.5


def test_a_steady_climb_is_growing_with_its_slope() -> None:
    samples = [400.0 + 5 * i for i in range(10)]  # 5 MB per sample, one sample a minute
    verdict = judge(samples, elapsed_s=540.0, flat_mb=20.0)
    assert verdict["verdict"] == "growing"
    assert verdict["slope_mb_per_min"] == pytest.approx(5.0)


def test_the_report_gives_the_verdict() -> None:
    samples = [400.0, 401.0, 400.0, 401.0, 400.0]
    results = {
        "plan": {"workload": "light", "clients": 64, "flat_mb": 20.0},
        "load": {"rps": 2000.0, "errors": 0},
        "rss_mb": samples,
        "sample_s": 5.0,
        "elapsed_s": 25.0,
        "start_mb": 399.0,
        "peak_rss_mb": 410.0,
        **judge(samples, 25.0, 20.0),
    }
    assert "| **flat** |" in render(results)
