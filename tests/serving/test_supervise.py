"""A served version's background work: a scale sample that raises (the reconciler's tick) and a
stats poll that raises (``serving.supervisor``) are logged with their traceback, counted in
``shardserve_background_errors_total{task}``, and taken again; a scale-up that raises is
logged and counted, and the next scale-up adds the replica."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from serving.elastic.steps import Scaler
from serving.metrics.series import BACKGROUND_TASKS
from serving.repository.reconciler import Reconciler
from serving.server.state import ServerState
from serving.settings.config import Settings
from shards.pipeline.health import Health
from tests.fakes import WAIT_S, FakeRunner, make_rows, spawn
from tests.metrics_text import metric
from tests.serving.elastic.test_scaling_loop import ElasticFake, elastic_settings, served, until

ERRORS = "shardserve_background_errors_total"


@pytest.fixture(autouse=True)
def restart_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("serving.supervisor.RESTART_S", (0.0, 0.0))


class TickFails(ElasticFake):
    """Its first look at the replicas' health (the first scale sample) raises."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.looks = 0

    def health(self) -> Health:
        self.looks += 1
        if self.looks == 1:
            raise RuntimeError("the replica table changed while it was read")
        return super().health()


class StatsFail(FakeRunner):
    """Its stats raise while ``failing`` is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failing = True
        self.polled = 0

    async def stats(self) -> list[dict[str, Any]]:
        if self.failing:
            raise ValueError("a stage answered its stats with None")
        self.polled += 1
        return await super().stats()


async def test_a_scale_sample_that_raises_is_logged_counted_and_taken_again_on_the_next_tick(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The reconciler samples each READY version's count on its ticks (``Reconciler.scale``).
    caplog.set_level(logging.ERROR, logger="shardserve")
    runner = TickFails()
    model = await served(elastic_settings(), runner)
    state = ServerState(elastic_settings(), metrics=model.server_metrics)
    state.models["m"] = {"1": model}
    reconciler = Reconciler(state, _no_factory, None)
    try:
        reconciler.scale(0.0)  # its first look raises
        reconciler.scale(0.5)  # not a period later: not sampled again
        reconciler.scale(1.0)
        reconciler.scale(2.0)
        assert runner.looks >= 3  # sampled again after the one that raised
        text = model.server_metrics.render().decode()
        assert metric(text, ERRORS, task="scaling") == 1.0
        # Every task's series is there from the start.
        assert {task: metric(text, ERRORS, task=task) for task in BACKGROUND_TASKS} == {
            task: 1.0 if task == "scaling" else 0.0 for task in BACKGROUND_TASKS
        }
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is not None  # once, with its traceback
        assert errors[0].getMessage() == (
            "model 'm' version 1's scale step failed (RuntimeError: the replica table changed "
            "while it was read)"
        )
        assert model.not_ready_reason() is None  # the version serves on
    finally:
        await reconciler.stop(1.0)
        await model.stop_jobs(1.0)


async def _no_factory(_: Settings) -> FakeRunner:
    raise AssertionError("this test loads nothing through the reconciler")


async def test_a_stats_poll_that_raises_is_logged_counted_and_polls_again(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("serving.version.stage_stats.STATS_PERIOD_S", 0.01)
    caplog.set_level(logging.ERROR, logger="shardserve")
    runner = StatsFail()
    model = await served(elastic_settings(min_replicas=1, max_replicas=1), runner)
    try:

        def counted() -> float:
            return metric(model.server_metrics.render().decode(), ERRORS, task="stats_poll")

        await until(lambda: counted() >= 1)
        runner.failing = False
        await until(lambda: runner.polled >= 2)  # the poll runs on
        failures = counted()
        errors = [r for r in caplog.records if "stats poll failed" in r.getMessage()]
        assert len(errors) == failures and all(r.exc_info is not None for r in errors)
        assert "(ValueError: a stage answered its stats with None)" in errors[0].getMessage()
    finally:
        await model.stop_jobs(1.0)


class AddFails(ElasticFake):
    """Its first ``add_replica`` raises (a bug below the scaler, not a replica given up)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.adds = 0

    async def add_replica(self, pending_timeout_s: float) -> bool:
        self.adds += 1
        if self.adds == 1:
            raise KeyError("replica 1")
        return await super().add_replica(pending_timeout_s)


async def test_a_scale_up_that_raises_is_logged_counted_and_the_next_one_adds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="shardserve")
    gate = asyncio.Event()
    gate.set()  # the warm-up batch goes through
    runner = AddFails(gate=gate)
    model = await served(elastic_settings(upscale_delay_s=1), runner)
    gate.clear()
    await model.stop_jobs(WAIT_S)  # the test ticks the scaler itself
    batcher = model.require_batcher()
    requests = [await spawn(batcher.submit(make_rows(4, start=i * 4))) for i in range(4)]
    await runner.wait_started(3)  # the warm-up, then 2 batches: rows queue behind them
    scaler = Scaler(model, runner, batcher)
    scaler.tick(0.0)
    assert scaler.tick(1.0).direction == "up"
    await until(lambda: not scaler.adds)
    text = model.server_metrics.render().decode()
    assert metric(text, ERRORS, task="scale_up") == 1.0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None  # once, with its traceback
    assert (
        errors[0]
        .getMessage()
        .startswith("model 'm' version 1's scale-up failed (KeyError: 'replica 1')")
    )
    # Given up like an add that found no room: the next scale-up, past the retry pause, adds.
    assert scaler.tick(5.0).direction == ""
    runner.place.set()
    assert scaler.tick(12.0).direction == "up"
    await until(lambda: runner.states == ["healthy", "healthy"] and not scaler.adds)
    assert metric(model.server_metrics.render().decode(), ERRORS, task="scale_up") == 1.0
    gate.set()
    await asyncio.gather(*requests)
