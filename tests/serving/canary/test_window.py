"""OutcomeWindow: one version's answered requests over the last window_s seconds, on a fake clock
(plain floats): what leaves the window, the failure rate, and a p99 equal to numpy's."""

from __future__ import annotations

import random

import numpy as np
import pytest

from serving.canary.window import OutcomeWindow


def test_an_empty_window_has_no_requests_no_failures_and_no_p99() -> None:
    window = OutcomeWindow(60.0)
    assert window.count(0.0) == 0
    assert window.failure_rate(0.0) == 0.0
    assert window.p99_s(0.0) is None


def test_a_request_leaves_the_window_once_window_s_has_passed() -> None:
    window = OutcomeWindow(10.0)
    window.add(100.0, failed=True, latency_s=0.5)
    window.add(105.0, failed=False, latency_s=0.1)
    assert window.count(109.9) == 2
    assert window.failure_rate(109.9) == 0.5
    # At 110.0 the first is window_s old: out, with its failure and its latency.
    assert window.count(110.0) == 1
    assert window.failure_rate(110.0) == 0.0
    assert window.p99_s(110.0) == pytest.approx(0.1)
    assert window.count(115.0) == 0
    assert window.p99_s(115.0) is None


def test_the_failure_rate_counts_the_failed_among_the_answered() -> None:
    window = OutcomeWindow(60.0)
    for i in range(200):
        window.add(i * 0.1, failed=i % 4 == 0, latency_s=0.01)
    assert window.count(20.0) == 200
    assert window.failure_rate(20.0) == 0.25


@pytest.mark.parametrize("n", [1, 2, 7, 100, 101, 5000])
def test_p99_is_numpys_percentile_of_the_window(n: int) -> None:
    rng = random.Random(n)
    window = OutcomeWindow(30.0)
    latencies = [rng.expovariate(20.0) for _ in range(n)]
    for i, latency in enumerate(latencies):
        window.add(i * 1e-3, failed=rng.random() < 0.1, latency_s=latency)
    assert window.p99_s(n * 1e-3) == pytest.approx(float(np.percentile(latencies, 99)), rel=1e-12)


def test_p99_follows_the_window_as_it_slides_and_grows_past_its_first_arrays() -> None:
    # 5000 requests over 50 s in a 10 s window: the arrays are compacted and regrown many times.
    rng = random.Random(7)
    window = OutcomeWindow(10.0)
    added: list[tuple[float, float]] = []
    for i in range(5000):
        now = i * 0.01
        latency = rng.uniform(0.0, 1.0) + (5.0 if i % 97 == 0 else 0.0)
        window.add(now, failed=False, latency_s=latency)
        added.append((now, latency))
        if i % 500 == 499:
            live = [lat for t, lat in added if now - t < 10.0]
            assert window.count(now) == len(live)
            assert window.p99_s(now) == pytest.approx(float(np.percentile(live, 99)))


def test_a_burst_then_quiet_gives_memory_back() -> None:
    window = OutcomeWindow(1.0)
    for i in range(100_000):
        window.add(i * 1e-5, failed=False, latency_s=0.01)
    # One request a second afterwards: the window holds one, the arrays shrink with it.
    for second in range(2, 40):
        window.add(float(second), failed=False, latency_s=0.01)
    assert window.count(39.5) == 1
    assert window.p99_s(39.5) == 0.01
    assert len(window._times) == 1024  # the first arrays' size again, not the burst's 131072


def test_clear_empties_the_window() -> None:
    window = OutcomeWindow(60.0)
    window.add(1.0, failed=True, latency_s=2.0)
    assert window.p99_s(1.0) == 2.0
    window.clear()
    assert window.count(1.0) == 0
    assert window.failure_rate(1.0) == 0.0
    assert window.p99_s(1.0) is None


def test_a_window_of_zero_seconds_is_refused() -> None:
    with pytest.raises(ValueError, match="window_s must be > 0"):
        OutcomeWindow(0.0)


def test_p99_is_recomputed_once_one_percent_of_the_window_changed() -> None:
    window = OutcomeWindow(60.0)
    fast = [i / 1000 for i in range(1000)]
    for i, latency in enumerate(fast):
        window.add(i * 1e-3, failed=False, latency_s=latency)
    before = float(np.percentile(fast, 99))
    assert window.p99_s(1.0) == pytest.approx(before)
    # 10 slow requests are under 1% of the 1010: the p99 read is the one before them, not
    # numpy's figure for the 1010.
    for _ in range(10):
        window.add(1.0, failed=False, latency_s=5.0)
    assert float(np.percentile(fast + [5.0] * 10, 99)) != pytest.approx(before)
    assert window.p99_s(1.0) == pytest.approx(before)
    window.add(1.0, failed=False, latency_s=5.0)
    assert window.p99_s(1.0) == pytest.approx(float(np.percentile(fast + [5.0] * 11, 99)))
    # Requests leaving the window count as changes too: at 60.5 those of t <= 0.5 have left.
    expected = float(np.percentile(fast[501:] + [5.0] * 11, 99))
    assert window.p99_s(60.5) == pytest.approx(expected)


def test_a_small_window_is_exact_after_every_change() -> None:
    window = OutcomeWindow(60.0)
    latencies: list[float] = []
    for i in range(100):
        latencies.append(0.001 * (i % 7) + (1.0 if i == 99 else 0.0))
        window.add(i * 0.1, failed=False, latency_s=latencies[-1])
        assert window.p99_s(i * 0.1) == pytest.approx(float(np.percentile(latencies, 99)))
