"""Whether a canary holds, is rolled back, or is promoted: its window against the stable's.

The order is the issue's: no decision on fewer than ``min_requests`` canary requests in the
window; then errors (canary failure rate over stable's + ``error_margin``, and significantly so:
see ``worse_by_errors``); then latency (canary p99 over ``max(latency_factor x stable p99,
stable p99 + 50 ms)``, judged only while the stable has a request in the window: there is
nothing to compare with otherwise); then, with ``promote = "auto"``, a canary that held for a
whole window is promoted, unless its failure rate is over the stable's + ``error_margin``.

Why a test and not the raw rates: a client that can make any request fail (an out-of-vocabulary
id, a 422) moves both versions' rates, since the split is a random draw it cannot steer. At 50%
such failures a canary of 100 requests has a rate of 0.50 +- 0.05, so "over stable + 0.02"
rolled back a copy of its stable in 16 of 20 runs. The judge runs after every few answers, so a
fixed-level test would be asked again and again until noise crosses it; the mixture sequential
probability ratio test (mSPRT: Johari, Pekelis, Walsh, "Always valid inference", 2017, the test
behind Optimizely's stats engine) stays within its false alarm rate ``alpha`` however often it is
asked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from serving.canary.config import LATENCY_SLACK_S, CanaryConfig
from serving.canary.window import OutcomeWindow

__all__ = ["Action", "Verdict", "judge", "worse_by_errors"]

Action = Literal["hold", "rollback", "promote"]
# The mixture's spread over the difference of failure rates: the test is most sensitive near
# differences of this size (0.1: a canary failing one request in ten more), and still detects
# any difference over the margin given enough requests.
_MIXTURE_SD = 0.1


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str  # the metric's label: "errors" | "latency"; "" for hold and promote
    detail: str  # one line for the log and the index: the figures compared


def judge(
    stable: OutcomeWindow,
    canary: OutcomeWindow,
    rules: CanaryConfig,
    now: float,
    canary_since: float,
) -> Verdict:
    n = canary.count(now)
    if n < rules.min_requests:
        return Verdict(
            "hold", "", f"{_requests(n)} to the canary in the window, {rules.min_requests} needed"
        )
    rate, stable_rate = canary.failure_rate(now), stable.failure_rate(now)
    ratio = worse_by_errors(
        stable.failures(now), stable.count(now), canary.failures(now), n, rules.error_margin
    )
    if ratio >= 1 / rules.alpha:
        return Verdict(
            "rollback",
            "errors",
            f"canary failure rate {rate:.2f} > stable {stable_rate:.2f} + "
            f"{rules.error_margin:.2f} over {_requests(n)} (likelihood ratio {_ratio(ratio)} "
            f">= 1/alpha {1 / rules.alpha:g})",
        )
    p99 = canary.p99_s(now)
    stable_p99 = stable.p99_s(now)  # None: no stable request in the window, no latency verdict
    if p99 is not None and stable_p99 is not None:
        bound = max(rules.latency_factor * stable_p99, stable_p99 + LATENCY_SLACK_S)
        if p99 > bound:
            return Verdict(
                "rollback",
                "latency",
                f"canary p99 {_ms(p99)} > {_ms(bound)} (max of {rules.latency_factor:g} x "
                f"stable p99 {_ms(stable_p99)}, stable p99 + {_ms(LATENCY_SLACK_S)}) over "
                f"{_requests(n)}",
            )
    figures = (
        f"canary failure rate {rate:.2f} (stable {stable_rate:.2f}), p99 {_ms(p99)} "
        f"(stable {_ms(stable_p99)}) over {_requests(n)}"
    )
    held = now - canary_since
    # Not promoted while its rate is over the bound, even short of evidence for a rollback: a
    # flood of client failures widens the noise, and must not carry a broken canary through.
    if rules.promote == "auto" and held >= rules.window_s and ratio == 0.0:
        return Verdict("promote", "", f"held for {held:.0f} s: {figures}")
    return Verdict("hold", "", figures)


def worse_by_errors(
    stable_failed: int, stable_n: int, canary_failed: int, canary_n: int, margin: float
) -> float:
    """The mSPRT's likelihood ratio for "the canary fails more than the stable + ``margin``"
    against "it fails at most that much" (normal approximation of the difference of the two
    rates, a normal mixture of spread ``_MIXTURE_SD`` over the difference); 0.0 where the
    observed difference is not over the margin. Roll back at ``>= 1 / alpha``.

    With no stable answer to compare with (the stable's weight 0), the canary's own rate is
    tested against the margin alone."""
    if canary_n <= 0:
        return 0.0
    canary_rate = canary_failed / canary_n
    over = canary_rate - margin
    variance = _variance(canary_failed, canary_n)
    if stable_n > 0:
        over -= stable_failed / stable_n
        variance += _variance(stable_failed, stable_n)
    if over <= 0:
        return 0.0
    spread = _MIXTURE_SD**2
    log_ratio = 0.5 * math.log(variance / (variance + spread)) + spread * over**2 / (
        2 * variance * (variance + spread)
    )
    return math.exp(min(log_ratio, 700.0))  # past e^700 a float overflows; it is a rollback


def _variance(failed: int, n: int) -> float:
    # The variance of a rate of n answers, with half a failure and half a success added
    # (Agresti's smoothing): 0 of n failed is not certainty, and a variance of 0 would make any
    # difference infinitely significant.
    p = (failed + 0.5) / (n + 1)
    return p * (1 - p) / n


def _ratio(ratio: float) -> str:
    return f"{ratio:.0f}" if ratio < 1e6 else f"{ratio:.1e}"


def _requests(n: int) -> str:
    return f"{n} request{'' if n == 1 else 's'}"


def _ms(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds * 1000:.0f} ms"
