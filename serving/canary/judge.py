"""Whether a canary holds, is rolled back, or is promoted: its window against the stable's.

The order is the issue's: no decision on fewer than ``min_requests`` canary requests in the
window; then errors (canary failure rate over stable's + ``error_margin``); then latency (canary
p99 over ``max(latency_factor x stable p99, stable p99 + 50 ms)``, judged only while the stable
has a request in the window: there is nothing to compare with otherwise); then, with
``promote = "auto"``, a canary that held for a whole window is promoted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from serving.canary.config import LATENCY_SLACK_S, CanaryConfig
from serving.canary.window import OutcomeWindow

__all__ = ["Action", "Verdict", "judge"]

Action = Literal["hold", "rollback", "promote"]


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
    if rate > stable_rate + rules.error_margin:
        return Verdict(
            "rollback",
            "errors",
            f"canary failure rate {rate:.2f} > stable {stable_rate:.2f} + "
            f"{rules.error_margin:.2f} over {_requests(n)}",
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
    if rules.promote == "auto" and held >= rules.window_s:
        return Verdict("promote", "", f"held for {held:.0f} s: {figures}")
    return Verdict("hold", "", figures)


def _requests(n: int) -> str:
    return f"{n} request{'' if n == 1 else 's'}"


def _ms(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds * 1000:.0f} ms"
