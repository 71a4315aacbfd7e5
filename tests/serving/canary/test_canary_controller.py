"""The canary controller on its own, over a clock the test moves: the weighted split, rollback
on errors and on latency from the answers recorded (the metric, the WARNING, the reason), no
decision below ``min_requests``, auto promotion after a whole window, and the conflicts the
admin API turns into 409s."""

from __future__ import annotations

import logging
import random
from itertools import pairwise

import pytest

from serving.canary.config import CanaryConfig, TrafficConfig
from serving.canary.controller import Rollout
from serving.errors import ConflictError
from serving.metrics.series import Metrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rollout(
    stable: int = 90, canary: int = 10, **rules: object
) -> tuple[Rollout, Clock, list[str], Metrics]:
    clock, changes, metrics = Clock(), [], Metrics()
    rules = {"min_requests": 20, "window_s": 10.0, **rules}
    traffic = TrafficConfig(stable, canary, CanaryConfig(**rules))  # type: ignore[arg-type]
    # The reconciler's canary step judges once the judge is due (here at once).
    made = Rollout(
        "m", "1", traffic, metrics, changes.append, on_due=lambda _: made.check(), clock=clock
    )
    made.start_canary("2")
    return made, clock, changes, metrics


OK, FAILED = False, True  # what the split-routed answers were to the judge


def answer(r: Rollout, clock: Clock, version: str, n: int, failed: bool, seconds: float) -> None:
    for _ in range(n):
        clock.now += 0.06
        r.record(version, failed, seconds)


def rollbacks(metrics: Metrics, reason: str) -> float | None:
    return metrics.registry.get_sample_value(
        "shardserve_rollbacks_total", {"model": "m", "version": "2", "reason": reason}
    )


def test_the_split_draws_each_request_at_its_weight_with_no_pattern_to_time() -> None:
    r, _, _, _ = rollout(90, 10)
    assert r.peek() == "1"
    picks = [r.pick() for _ in range(20_000)]
    assert 0.09 < picks.count("2") / len(picks) < 0.11
    # A round robin sent every 10th request to the canary: a client could time its requests
    # to land there. Drawn, the gaps between canary picks vary as a geometric law's do.
    at = [i for i, pick in enumerate(picks) if pick == "2"]
    gaps = {b - a for a, b in pairwise(at)}
    assert 1 in gaps and max(gaps) > 40
    r.set_weights(0, 5)
    assert {r.pick() for _ in range(10)} == {"2"}


def test_a_canary_failing_over_the_margin_is_rolled_back_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r, clock, changes, metrics = rollout()
    answer(r, clock, "1", 50, OK, 0.01)
    answer(r, clock, "2", 10, FAILED, 0.01)
    answer(r, clock, "2", 9, FAILED, 0.01)  # 19 canary answers: no decision yet
    assert r.state == "canary" and changes == []
    with caplog.at_level(logging.WARNING, logger="shardserve"):
        answer(r, clock, "2", 1, OK, 0.01)
    assert r.state == "rolled_back" and r.canary == "2"
    assert r.weights == (90, 0) and {r.pick() for _ in range(50)} == {"1"}
    assert r.reason.startswith(
        "rolled back: canary failure rate 0.95 > stable 0.00 + 0.02 over 20 requests "
        "(likelihood ratio "
    )
    assert rollbacks(metrics, "errors") == 1.0
    assert changes == ["m"]  # the manager moves the labels
    (line,) = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert "model 'm' version 2 rolled back (errors): canary failure rate 0.95" in line.message


def test_a_canary_whose_p99_is_over_the_bound_is_rolled_back_on_latency() -> None:
    r, clock, _, metrics = rollout()
    answer(r, clock, "1", 50, OK, 0.010)
    answer(r, clock, "2", 20, OK, 0.055)  # under max(2 x 10 ms, 10 ms + 50 ms): holds
    assert r.state == "canary"
    answer(r, clock, "2", 1, OK, 0.080)  # p99 75 ms (between 55 and 80) > 60 ms
    assert r.state == "rolled_back"
    assert r.reason == (
        "rolled back: canary p99 75 ms > 60 ms (max of 2 x stable p99 10 ms, stable p99 + "
        "50 ms) over 21 requests"
    )
    assert rollbacks(metrics, "latency") == 1.0 and rollbacks(metrics, "errors") is None


def test_a_canary_that_holds_a_whole_window_is_promoted_when_auto() -> None:
    r, clock, changes, _ = rollout(promote="auto")
    answer(r, clock, "1", 40, OK, 0.01)
    answer(r, clock, "2", 30, OK, 0.01)
    assert r.state == "canary"  # held 4.2 s of its 10 s window
    clock.now += 9.5
    answer(r, clock, "2", 1, OK, 0.01)  # the older answers left the window: hold
    assert r.state == "canary"
    answer(r, clock, "2", 25, OK, 0.01)
    assert (r.stable, r.canary, r.state, r.weights) == ("2", None, "stable", (100, 0))
    assert changes == ["m"]  # the manager retires version 1
    assert {r.pick() for _ in range(10)} == {"2"}


def test_the_tick_promotes_a_canary_with_no_new_answer() -> None:
    r, clock, _, _ = rollout(promote="auto", min_requests=5)
    answer(r, clock, "1", 5, OK, 0.01)
    answer(r, clock, "2", 5, OK, 0.01)
    clock.now += 9.45  # a whole window since the canary began, its answers still in it
    r.check()
    assert r.stable == "2"


def test_what_cannot_be_done_is_a_conflict_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("serving.canary.split._system_random", lambda: random.Random(5))
    r, _, _, metrics = rollout()
    r.rollback("manual", "through the admin API")
    assert rollbacks(metrics, "manual") == 1.0
    with pytest.raises(ConflictError, match="its canary rolled back already"):
        r.rollback("manual", "again")
    # Given a share again, the canary is judged afresh.
    r.set_weights(50, 50)
    assert (r.state, r.reason, r.weights) == ("canary", None, (50, 50))
    picks = [r.pick() for _ in range(400)]  # drawn: about half each
    assert 150 < picks.count("2") < 250 and set(picks) == {"1", "2"}
    r.promote()
    with pytest.raises(ConflictError, match="model 'm' has no canary to promote; its stable"):
        r.promote()
    with pytest.raises(ConflictError, match="has no canary; nothing to roll back"):
        r.rollback("manual", "x")
    with pytest.raises(ConflictError, match="has no canary: weights split"):
        r.set_weights(50, 50)


def test_the_stable_is_judged_over_the_same_time_as_its_canary() -> None:
    # A client that failed nothing before the canary began and half of everything after: with
    # the stable's earlier answers kept, the canary alone would look worse.
    clock, metrics = Clock(), Metrics()
    traffic = TrafficConfig(90, 10, CanaryConfig(min_requests=20, window_s=1000.0))
    r = Rollout("m", "1", traffic, metrics, lambda _: None, on_due=lambda _: r.check(), clock=clock)
    answer(r, clock, "1", 2000, OK, 0.01)
    r.start_canary("2")
    for _ in range(40):
        answer(r, clock, "1", 9, OK, 0.01)
        answer(r, clock, "1", 9, FAILED, 0.01)
        answer(r, clock, "2", 1, OK, 0.01)
        answer(r, clock, "2", 1, FAILED, 0.01)
    assert r.state == "canary"
    assert r.windows["1"].count(clock.now) == 720
