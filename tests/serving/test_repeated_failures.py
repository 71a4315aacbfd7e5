"""A step a controller takes again and again and that keeps failing (the reconciler's step of a
model, a canary's judge): its traceback is logged once, then one line with the count at most a
minute, and it is taken again after a pause that doubles up to a minute; its first success says
how many failures it ended. Before, each tick logged a full traceback per model, every second."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from serving.canary.controller import Rollouts
from serving.metrics.series import Metrics
from serving.repository.reconciler import Reconciler
from serving.server.state import ServerState
from serving.settings.config import Settings
from serving.supervisor import RepeatedFailures


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == level]


def test_a_failure_that_repeats_is_logged_once_then_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="shardserve")
    clock = Clock()
    failures = RepeatedFailures(clock)
    pauses = []
    for _ in range(100):
        failures.failed("k", "model 'm''s step", RuntimeError("disk full\ntraceback text"))
        pauses.append(failures.wait_s("k"))
        clock.now += 2.0
    (error,) = records(caplog, logging.ERROR)
    assert error.exc_info is not None
    assert error.getMessage() == "model 'm''s step failed (RuntimeError: disk full)"
    assert pauses[:7] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0] and max(pauses) == 60.0
    warnings = records(caplog, logging.WARNING)
    assert len(warnings) == 3  # 200 s of failures: one line a minute, no traceback
    assert all(r.exc_info is None for r in warnings)
    assert warnings[0].getMessage() == (
        "model 'm''s step failed again (RuntimeError: disk full): 30 more times in the last "
        "60 s, 31 since it began 60 s ago; taken again every 60 s"
    )
    failures.failed("k", "model 'm''s step", KeyError("another"))  # a new error: its traceback
    assert len(records(caplog, logging.ERROR)) == 2
    failures.succeeded("k", "model 'm''s step")
    assert failures.wait_s("k") == 0.0
    assert records(caplog, logging.INFO)[-1].getMessage() == (
        "model 'm''s step succeeded after 1 failure in 0 s"
    )


async def _no_factory(_: Settings) -> Any:
    raise AssertionError("nothing loads here")


async def test_a_reconcile_step_that_always_raises_backs_off_and_logs_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="shardserve")
    reconciler = Reconciler(ServerState(Settings()), _no_factory, None)
    clock = Clock()
    monkeypatch.setattr(reconciler, "_failures", RepeatedFailures(clock))
    tries: list[float] = []

    async def step(name: str) -> None:
        tries.append(clock.now)
        raise OSError("the repository's disk is gone")

    monkeypatch.setattr(reconciler, "step", step)
    reconciler.plans["m"] = object()  # type: ignore[assignment]
    try:
        for _ in range(120):  # two minutes of ticks, a second apart
            await reconciler.tick()
            clock.now += 1.0
        assert [t - 1000.0 for t in tries] == [0.0, 1.0, 3.0, 7.0, 15.0, 31.0, 63.0]
        errors = records(caplog, logging.ERROR)
        assert len(errors) == 1 and errors[0].exc_info is not None
        assert errors[0].getMessage() == (
            "model 'm''s reconcile step failed (OSError: the repository's disk is gone)"
        )
        assert len(records(caplog, logging.WARNING)) == 1
        text = reconciler.state.metrics.render().decode()
        assert 'shardserve_background_errors_total{task="reconcile"} 7.0' in text
    finally:
        await reconciler.stop(1.0)


class BrokenRollout:
    name = "m"

    def __init__(self) -> None:
        self.checks = 0

    def check(self) -> None:
        self.checks += 1
        raise ZeroDivisionError("float division by zero")


def test_a_canary_judge_that_always_raises_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="shardserve")
    rollouts = Rollouts({}, Metrics(), lambda _: None, lambda _: None)
    broken = BrokenRollout()
    rollouts._rollouts["m"] = broken  # type: ignore[assignment]
    clock = Clock()
    rollouts._failures = RepeatedFailures(clock)
    for _ in range(60):
        rollouts.check()
        clock.now += 1.0
    assert broken.checks == 6  # 0, 1, 3, 7, 15, 31 s
    (error,) = records(caplog, logging.ERROR)
    assert error.getMessage() == (
        "model 'm': judging its canary failed (ZeroDivisionError: float division by zero)"
    )
