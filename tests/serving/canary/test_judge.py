"""judge: a canary's window against the stable's, on a fake clock. No decision below
min_requests; rollback on errors (significantly over the margin, not noise), then on latency (with the 50 ms slack, and only with a stable
request to compare with); auto promotion after a whole window; manual never promotes."""

from __future__ import annotations

import pytest

from serving.canary.config import LATENCY_SLACK_S, CanaryConfig
from serving.canary.judge import Verdict, judge
from serving.canary.window import OutcomeWindow

NOW = 1000.0
SINCE = NOW - 5.0  # the canary started 5 s ago: not a whole window


def fill(
    window: OutcomeWindow, n: int, *, failed: int = 0, latency_s: float = 0.010, end: float = NOW
) -> None:
    """n requests answered in the second before ``end``, the first ``failed`` of them failed."""
    for i in range(n):
        window.add(end - 1.0 + i / n, failed=i < failed, latency_s=latency_s)


def windows() -> tuple[OutcomeWindow, OutcomeWindow]:
    return OutcomeWindow(60.0), OutcomeWindow(60.0)


def test_fewer_canary_requests_than_min_requests_hold_whatever_they_show() -> None:
    stable, canary = windows()
    fill(stable, 1000)
    fill(canary, 99, failed=99, latency_s=10.0)
    verdict = judge(stable, canary, CanaryConfig(min_requests=100), NOW, SINCE)
    assert verdict == Verdict("hold", "", "99 requests to the canary in the window, 100 needed")


def test_requests_that_left_the_window_do_not_count_towards_min_requests() -> None:
    stable, canary = windows()
    fill(canary, 150, failed=150, end=NOW - 60.0)  # a minute ago: out of a 60 s window
    fill(canary, 50, failed=50)
    verdict = judge(stable, canary, CanaryConfig(min_requests=100), NOW, SINCE)
    assert verdict.action == "hold"


def test_a_canary_failing_more_than_stable_plus_the_margin_is_rolled_back_on_errors() -> None:
    stable, canary = windows()
    fill(stable, 1000, failed=10)  # 0.01
    fill(canary, 130, failed=81)  # 0.62
    verdict = judge(stable, canary, CanaryConfig(min_requests=100), NOW, SINCE)
    assert verdict == Verdict(
        "rollback",
        "errors",
        "canary failure rate 0.62 > stable 0.01 + 0.02 over 130 requests "
        "(likelihood ratio 1.3e+35 >= 1/alpha 100)",
    )


def test_a_canary_within_the_error_margin_holds_and_one_clearly_over_it_does_not() -> None:
    stable, canary = windows()
    fill(stable, 1000, failed=10)  # 0.01
    fill(canary, 100, failed=3)  # 0.03 = 0.01 + 0.02: at the bound, not over it
    verdict = judge(stable, canary, CanaryConfig(min_requests=100), NOW, SINCE)
    assert verdict.action == "hold"
    fill(canary, 1, failed=1)  # 4 / 101 = 0.0396: over, but one failure is no evidence
    assert judge(stable, canary, CanaryConfig(min_requests=100), NOW, SINCE).action == "hold"
    fill(canary, 99, failed=19)  # 23 / 200 = 0.115
    assert judge(stable, canary, CanaryConfig(min_requests=100), NOW, SINCE).reason == "errors"


def test_noise_over_the_margin_is_not_a_rollback_when_both_versions_fail_alike() -> None:
    # A client fails half of all requests (an out-of-vocabulary id): the canary's 100 show
    # 0.58 against the stable's 0.50, 1.6 standard deviations; raw rates rolled it back.
    stable, canary = windows()
    fill(stable, 900, failed=450)
    fill(canary, 100, failed=58)
    verdict = judge(stable, canary, CanaryConfig(min_requests=100), NOW, SINCE)
    assert verdict.action == "hold"
    assert verdict.detail.startswith("canary failure rate 0.58 (stable 0.50)")


def test_alpha_sets_how_much_evidence_a_rollback_needs() -> None:
    stable, canary = windows()
    fill(stable, 900, failed=450)
    fill(canary, 300, failed=200)  # 0.67 against 0.50: a likelihood ratio of 4,391
    assert judge(stable, canary, CanaryConfig(alpha=0.01), NOW, SINCE).action == "rollback"
    assert judge(stable, canary, CanaryConfig(alpha=1e-4), NOW, SINCE).action == "hold"


def test_with_no_stable_answer_the_canary_is_judged_against_the_margin_alone() -> None:
    stable, canary = windows()
    fill(canary, 100, failed=40)
    verdict = judge(stable, canary, CanaryConfig(min_requests=100), NOW, SINCE)
    assert (verdict.action, verdict.reason) == ("rollback", "errors")
    canary.clear()
    fill(canary, 100, failed=2)
    assert judge(stable, canary, CanaryConfig(min_requests=100), NOW, SINCE).action == "hold"


def test_errors_are_judged_before_latency() -> None:
    stable, canary = windows()
    fill(stable, 200)
    fill(canary, 100, failed=50, latency_s=5.0)
    assert judge(stable, canary, CanaryConfig(), NOW, SINCE).reason == "errors"


def test_a_canary_over_the_latency_factor_is_rolled_back_on_latency() -> None:
    stable, canary = windows()
    fill(stable, 500, latency_s=0.200)
    fill(canary, 100, latency_s=0.401)  # over 2 x 200 ms (and over 200 + 50 ms)
    verdict = judge(stable, canary, CanaryConfig(), NOW, SINCE)
    assert verdict.action == "rollback" and verdict.reason == "latency"
    assert verdict.detail == (
        "canary p99 401 ms > 400 ms (max of 2 x stable p99 200 ms, stable p99 + 50 ms) "
        "over 100 requests"
    )
    canary.clear()
    fill(canary, 100, latency_s=0.399)
    assert judge(stable, canary, CanaryConfig(), NOW, SINCE).action == "hold"


def test_a_fast_stable_gives_the_canary_50_ms_of_slack_over_the_factor() -> None:
    # Stable p99 5 ms: 2 x 5 ms = 10 ms would roll back on noise; the bound is 5 + 50 = 55 ms.
    stable, canary = windows()
    fill(stable, 500, latency_s=0.005)
    fill(canary, 100, latency_s=0.050)
    assert judge(stable, canary, CanaryConfig(), NOW, SINCE).action == "hold"
    canary.clear()
    fill(canary, 100, latency_s=0.005 + LATENCY_SLACK_S + 0.001)
    verdict = judge(stable, canary, CanaryConfig(), NOW, SINCE)
    assert (verdict.action, verdict.reason) == ("rollback", "latency")


def test_a_slow_p99_not_just_a_slow_request_rolls_back() -> None:
    # Two slow requests of 1000 stay above the p99: the canary's p99 is its fast requests'.
    stable, canary = windows()
    fill(stable, 1000, latency_s=0.010)
    fill(canary, 1000, latency_s=0.010)
    canary.add(NOW, failed=False, latency_s=9.0)
    assert judge(stable, canary, CanaryConfig(), NOW, SINCE).action == "hold"


def test_no_latency_verdict_while_stable_has_no_request_in_the_window() -> None:
    stable, canary = windows()
    fill(stable, 100, latency_s=0.001, end=NOW - 61.0)  # left the window
    fill(canary, 100, latency_s=30.0)
    verdict = judge(stable, canary, CanaryConfig(), NOW, SINCE)
    assert verdict.action == "hold"
    assert "stable none" in verdict.detail


def test_auto_promotes_a_canary_that_held_for_a_whole_window() -> None:
    stable, canary = windows()
    fill(stable, 900)
    fill(canary, 100)
    rules = CanaryConfig(promote="auto")
    assert judge(stable, canary, rules, NOW, NOW - 59.9).action == "hold"
    verdict = judge(stable, canary, rules, NOW, NOW - 60.0)
    assert verdict.action == "promote" and verdict.reason == ""
    assert verdict.detail.startswith("held for 60 s: canary failure rate 0.00 (stable 0.00)")


def test_auto_does_not_promote_a_canary_with_too_few_requests_or_over_a_bound() -> None:
    rules = CanaryConfig(promote="auto")
    stable, canary = windows()
    fill(stable, 900)
    fill(canary, 99)
    assert judge(stable, canary, rules, NOW, NOW - 600.0).action == "hold"
    fill(canary, 30, failed=30)
    assert judge(stable, canary, rules, NOW, NOW - 600.0).action == "rollback"


def test_manual_never_promotes() -> None:
    stable, canary = windows()
    fill(stable, 900)
    fill(canary, 10_000)
    verdict = judge(stable, canary, CanaryConfig(promote="manual"), NOW, NOW - 3600.0)
    assert verdict.action == "hold"


@pytest.mark.parametrize("n", [1, 2])
def test_the_hold_detail_says_request_in_the_singular(n: int) -> None:
    stable, canary = windows()
    fill(canary, n)
    detail = judge(stable, canary, CanaryConfig(min_requests=5), NOW, SINCE).detail
    assert detail.startswith(f"{n} request{'s' if n > 1 else ''} to the canary")
