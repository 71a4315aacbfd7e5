"""A served model is a thing of its own, found by name in the server's state: two of them in one
state keep their own runner, batcher and life, and a stop reaches each of them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from serving.errors import InvalidInputError, NotFoundError, NotReadyError
from serving.metrics.series import Metrics
from serving.server.state import ServerState
from serving.settings.config import Settings
from serving.version.life import VersionState
from serving.version.served import ServedModel
from shards.signature import ModelSignature, TensorSpec
from tests.fakes import WAIT_S, FakeRunner, make_rows
from tests.metrics_text import metric


def _state(*names: str) -> ServerState:
    state = ServerState(Settings(model="fake", batch_timeout_ms=0.0))
    for name in names:
        state.add_model(ServedModel(name, state.settings, state.metrics))
    return state


async def _load(model: ServedModel, runner: FakeRunner) -> None:
    async def factory(_: Settings) -> FakeRunner:
        return runner

    await model.load(factory, None)
    assert model.state is VersionState.READY, model.reason


async def test_models_are_found_by_name_and_version_and_a_miss_names_what_is_served() -> None:
    state = _state("a", "b")
    assert state.model("b").name == "b"
    with pytest.raises(InvalidInputError, match=r"several models \('a', 'b'\) and none is"):
        state.model()  # /predict's: no default among several (tests/serving/server/test_state.py)
    assert state.model("a", "1") is state.model("a")
    with pytest.raises(NotFoundError, match=r"model 'c' not found; this server serves 'a', 'b'"):
        state.model("c")
    with pytest.raises(NotFoundError, match=r"model 'a' has no version '2'; its versions: \['1'\]"):
        state.model("a", "2")
    with pytest.raises(ValueError, match="model 'a' version '1' is served already"):
        state.add_model(ServedModel("a", state.settings, Metrics()))


async def test_two_models_keep_their_own_runner_and_batcher_and_a_stop_reaches_both() -> None:
    state = _state("a", "b")
    a, b = FakeRunner(), FakeRunner()
    await _load(state.model("a"), a)
    assert state.not_ready_reason() == "model is still loading"  # b is not loaded yet
    await _load(state.model("b"), b)
    assert state.not_ready_reason() is None
    a.batches.clear()
    b.batches.clear()
    await state.model("b").require_batcher().submit(make_rows(1), deadline=_in(WAIT_S))
    assert (len(a.batches), len(b.batches)) == (0, 1)

    budget = state.begin_stop()
    for name in ("a", "b"):
        with pytest.raises(NotReadyError, match="server is shutting down"):
            state.model(name).require_batcher()
    await state.drain(budget)
    await asyncio.gather(*(m.close(budget.left()) for m in state.served()))
    assert a.closed and b.closed


async def test_a_model_that_finishes_loading_after_the_stop_began_takes_no_request() -> None:
    state = _state("a")
    model = state.model()
    gate = asyncio.Event()
    runner = FakeRunner(gate=gate)  # its warm-up batch waits on the gate

    async def factory(_: Settings) -> FakeRunner:
        return runner

    load = asyncio.create_task(model.load(factory, None))
    await runner.wait_started(1)
    budget = state.begin_stop()
    gate.set()
    await asyncio.wait_for(load, WAIT_S)
    assert model.phase == "stopping"  # its load completed: not "still loading"
    with pytest.raises(NotReadyError, match="server is shutting down"):
        model.require_batcher()
    assert model.not_ready_reason() == "server is shutting down"
    await model.drain(budget)


async def test_the_warm_up_batch_runs_at_the_max_sequence_length() -> None:
    tokens = ModelSignature(
        "tokens",
        inputs=(TensorSpec("ids", (None,), "int32"), TensorSpec("image", (4, None, 3), "float32")),
        outputs=(TensorSpec("y", (2,), "float32"),),
    )
    state = ServerState(Settings(model="fake", batch_timeout_ms=0.0, max_sequence_length=40))
    model = ServedModel("tokens", state.settings, state.metrics)
    runner = FakeRunner(tokens)
    await _load(model, runner)
    (warm_up,) = runner.batches
    assert warm_up["ids"].shape == (1, 40)
    assert warm_up["image"].shape == (1, 4, 40, 3)


async def test_a_warm_up_failure_at_the_max_sequence_length_names_it() -> None:
    tokens = ModelSignature("tokens", (TensorSpec("ids", (None,), "int32"),), ())
    state = ServerState(Settings(model="fake", batch_timeout_ms=0.0, max_sequence_length=600))
    model = ServedModel("tokens", state.settings, state.metrics)
    await model.load(_factory(FakeRunner(tokens, fail_with=ValueError("index 600 >= 512"))), None)
    assert model.state is VersionState.FAILED and model.reason is not None
    assert "warm-up batch at max_sequence_length=600 failed" in model.reason
    assert "index 600 >= 512" in model.reason
    assert "--max-sequence-length at most its longest" in model.reason


@pytest.mark.parametrize(("flag", "warmed_at"), [(None, 32), (16, 16), (32, 32)])
async def test_the_models_own_bound_is_the_default_length_and_a_flag_may_lower_it(
    flag: int | None, warmed_at: int
) -> None:
    bounded = ModelSignature("tokens", (TensorSpec("ids", (None,), "int32", max_length=32),), ())
    state = ServerState(
        Settings(model="fake", batch_timeout_ms=0.0, max_sequence_length=flag, pad_lengths=False)
    )
    model = ServedModel("tokens", state.settings, state.metrics)
    runner = FakeRunner(bounded)
    await _load(model, runner)
    (warm_up,) = runner.batches
    assert warm_up["ids"].shape == (1, warmed_at)


async def test_a_flag_over_the_models_own_bound_is_refused_at_load_with_both_numbers() -> None:
    bounded = ModelSignature("tokens", (TensorSpec("ids", (None,), "int32", max_length=32),), ())
    state = ServerState(Settings(model="fake", batch_timeout_ms=0.0, max_sequence_length=64))
    model = ServedModel("tokens", state.settings, state.metrics)
    runner = FakeRunner(bounded)
    await model.load(_factory(runner), None)
    assert model.state is VersionState.FAILED and model.reason is not None
    assert "max_sequence_length=64 is over 32, the longest input model 'tokens' takes" in (
        model.reason
    )
    assert runner.batches == []  # refused before any warm-up batch


def _factory(runner: FakeRunner) -> Callable[[Settings], Awaitable[FakeRunner]]:
    async def factory(_: Settings) -> FakeRunner:
        return runner

    return factory


def _in(seconds: float) -> float:
    return time.monotonic() + seconds


class _HangingStats(FakeRunner):
    """A runner whose first stats call never returns: a stage actor that hangs, not dies."""

    def __init__(self) -> None:
        super().__init__()
        self.stats_calls = 0
        self.answered = asyncio.Event()

    async def stats(self) -> list[dict[str, object]]:
        self.stats_calls += 1
        if self.stats_calls == 1:
            await asyncio.Event().wait()
        self.answered.set()
        return await super().stats()


async def test_a_stats_poll_that_hangs_is_dropped_and_the_next_one_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import serving.version.stage_stats as polled

    monkeypatch.setattr(polled, "STATS_PERIOD_S", 0.01)
    monkeypatch.setattr(polled, "STATS_TIMEOUT_S", 0.05)
    model = _state("a").model("a")
    runner = _HangingStats()
    model.runner = runner
    poll = asyncio.create_task(polled.poll_stats(model))
    try:
        await asyncio.wait_for(runner.answered.wait(), timeout=10)
    finally:
        poll.cancel()
    assert runner.stats_calls >= 2


async def test_the_state_gauge_follows_the_versions_state_machine() -> None:
    state = _state("a")
    model = state.model()

    def states() -> dict[str, float]:
        text = state.metrics.render().decode()
        return {
            s.value: metric(text, "shardserve_version_state", model="a", version="1", state=s)
            for s in VersionState
        }

    assert states() == {s.value: float(s is VersionState.LOADING) for s in VersionState}
    runner = FakeRunner()
    await _load(model, runner)
    assert states() == {s.value: float(s is VersionState.READY) for s in VersionState}
    await model.retire("model 'a' version 1 is being unloaded (test)")
    assert states() == {s.value: float(s is VersionState.RETIRED) for s in VersionState}
    state.metrics.remove_model("a", "1")
    assert "shardserve_version_state{" not in state.metrics.render().decode()
