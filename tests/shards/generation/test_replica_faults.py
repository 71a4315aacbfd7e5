"""How the driver's replica tells a step's failures apart, with fake stages (no actors): the
model raising fails the step's rows, a lost stage loses the replica until it is ready again."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import ray

from shards.errors import ModelError
from shards.generation import GenerationInfo, ReplicaLost, RowStep, Sampling, StepFailed
from shards.generation.replica import Replica

INFO = GenerationInfo(
    model_family="gpt2",
    vocabulary_size=50,
    max_length=16,
    kv_slots=4,
    stages=2,
    end_token_ids=(0,),
    start_token_id=0,
    tokenizer_dir=None,
    tokenizer_kind=None,
)


class _Method:
    def __init__(self, stage: _Stage, name: str) -> None:
        self.stage, self.name = stage, name

    def remote(self, *args: Any) -> Any:
        return self.stage.call(self.name, args)


class _Stage:
    """A stage whose answers the test sets: ``fail`` raised by forward, else a value."""

    def __init__(self, last: bool) -> None:
        self.last = last
        self.fail: BaseException | None = None
        self.calls = 0
        self.forward = _Method(self, "forward")
        self.ready = _Method(self, "ready")

    async def _answer(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "ready":
            return "incarnation"
        if inspect.isawaitable(args[0]):
            # As Ray resolves an ObjectRef argument: the upstream stage's error passes down.
            args = (await args[0], *args[1:])
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        if not self.last:
            return args[0]
        rows = len(args[-1])
        return [7] * rows, [-0.5] * rows

    def call(self, name: str, args: tuple[Any, ...]) -> Any:
        return self._answer(name, args)


async def _replica() -> tuple[Replica, list[_Stage]]:
    stages = [_Stage(False), _Stage(True)]
    replica = Replica(INFO, None, stages, None, ready_timeout_s=5.0)  # type: ignore[arg-type]
    await replica.wait_ready()
    return replica, stages


ROWS = [RowStep(0, (1, 2), 0, Sampling(), 0), RowStep(3, (4,), 5, Sampling(), 2)]


async def test_results_come_back_in_row_order() -> None:
    replica, _ = await _replica()
    results = await replica.step(ROWS)
    assert [(r.slot, r.token_id, r.logprob) for r in results] == [(0, 7, -0.5), (3, 7, -0.5)]


async def test_the_model_raising_fails_every_row_of_the_step_and_nothing_else() -> None:
    replica, stages = await _replica()
    stages[1].fail = ModelError("InvalidArgumentError: indices[3] = 99 is not in [0, 50)")
    with pytest.raises(StepFailed, match="the model raised on this step") as info:
        await replica.step(ROWS)
    assert info.value.slots == (0, 3)
    stages[1].fail = None
    assert len(await replica.step(ROWS)) == 2  # the replica is fine


async def test_a_lost_stage_loses_the_replica_until_it_is_ready_again() -> None:
    replica, stages = await _replica()
    stages[0].fail = ray.exceptions.ActorDiedError()
    with pytest.raises(ReplicaLost):
        await replica.step(ROWS)
    stages[0].fail = None
    calls = stages[0].calls
    with pytest.raises(ReplicaLost):
        await replica.step(ROWS)  # refused before any stage is asked
    assert stages[0].calls == calls
    await replica.wait_ready()
    assert len(await replica.step(ROWS)) == 2


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        (RowStep(4, (1,), 0, Sampling(), 0), "slot 4 is outside 0..3"),
        (RowStep(1, (), 0, Sampling(), 0), "at least one new token"),
        (RowStep(1, (1, 2), 15, Sampling(), 0), "positions 15..16 do not fit the slot length 16"),
        (RowStep(1, (50,), 0, Sampling(), 0), "token id 50 is outside the vocabulary"),
        (RowStep(1, (1,), 0, Sampling(temperature=-1.0), 0), "temperature must be"),
        (RowStep(0, (1,), 3, Sampling(), 0), "slot 0 appears twice"),
    ],
)
async def test_a_bad_row_is_refused_by_its_slot_before_any_stage_runs(
    row: RowStep, reason: str
) -> None:
    replica, stages = await _replica()
    with pytest.raises(StepFailed, match=reason) as info:
        await replica.step([ROWS[0], row])
    assert info.value.slots == (row.slot,)
    assert stages[0].calls == 0
