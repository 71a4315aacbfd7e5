"""Poison rows: the model raises on some requests' rows, not on their batch-mates'. The batch is
split by request and rerun until only the requests that trigger the error get it; errors the
input is not blamed for, and the runner's faults, fail the batch without reruns."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from serving.errors import BatchFailedError, ModelInputError, ShardServeError
from shards.errors import ModelError, NoHealthyReplicaError, ReplicaLostError, StageTimeoutError
from tests.fakes import FakeRunner, make_rows, settle
from tests.serving.batching.harness import LONG_MS, Harness, assert_rows


def _poisoned(i: int) -> dict[str, np.ndarray]:
    rows = make_rows(1, start=i)
    rows["x"][0, 0] = -1000.0 - i  # the fake model raises on a negative first value
    return rows


async def test_a_poison_row_fails_only_its_own_request(make: Harness) -> None:
    runner = FakeRunner(poison=True)
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms=LONG_MS)
    inputs = [_poisoned(i) if i == 5 else make_rows(1, start=i) for i in range(8)]

    outcomes = await asyncio.gather(*(settle(batcher.submit(x)) for x in inputs))

    bad = outcomes[5]
    assert isinstance(bad, ModelInputError) and bad.status_code == 422
    assert str(bad) == (
        "the model failed on this input: InvalidArgumentError: indices[0,0] = -1005 "
        "is not in [0, 10)"
    )
    for i, (outcome, x) in enumerate(zip(outcomes, inputs, strict=True)):
        if i != 5:
            assert isinstance(outcome, dict), (i, outcome)
            assert_rows(outcome, x)
    await batcher.stop()  # the batch's record is written once its reruns are done
    # 8 requests: the whole batch, then halves down to the poisoned one, 2 runs per level.
    assert runner.batch_sizes()[0] == 8
    assert len(runner.batches) == 1 + 2 * 3
    assert [(r.ok, r.isolated) for r in make.records] == [(False, 1)]


async def test_two_poison_rows_in_one_batch_are_both_found(make: Harness) -> None:
    runner = FakeRunner(poison=True)
    batcher = await make(runner, max_batch_size=6, batch_timeout_ms=LONG_MS)
    inputs = [_poisoned(i) if i in (0, 4) else make_rows(1, start=i) for i in range(6)]

    outcomes = await asyncio.gather(*(settle(batcher.submit(x)) for x in inputs))

    assert [isinstance(o, ModelInputError) for o in outcomes] == [
        True, False, False, False, True, False
    ]  # fmt: skip
    for i in (1, 2, 3, 5):
        assert_rows(outcomes[i], inputs[i])  # type: ignore[arg-type]
    await batcher.stop()
    assert make.records[0].isolated == 2


async def test_an_error_the_input_is_not_blamed_for_fails_the_batch_without_reruns(
    make: Harness,
) -> None:
    runner = FakeRunner(fail_with=ModelError("ResourceExhaustedError: OOM", input_blamed=False))
    batcher = await make(runner, max_batch_size=4, batch_timeout_ms=LONG_MS)

    outcomes = await asyncio.gather(
        *(settle(batcher.submit(make_rows(1, start=i))) for i in range(4))
    )

    assert all(isinstance(o, BatchFailedError) for o in outcomes)
    assert str(outcomes[0]) == "model failed on a batch of 4 rows: ResourceExhaustedError: OOM"
    assert len(runner.batches) == 1  # not the input's fault: no bisection
    assert make.records[0].isolated == 0


@pytest.mark.parametrize(
    ("raised", "status", "message"),
    [
        (ReplicaLostError("a stage process failed: ActorDiedError, on two replicas"), 500,
         "the request's batch was lost: a stage process failed: ActorDiedError, on two replicas"),
        (StageTimeoutError("the batch ran past the watchdog's limit of 3 s"), 504,
         "the request's batch was abandoned: the batch ran past the watchdog's limit of 3 s"),
        (NoHealthyReplicaError("no healthy replica of 2"), 503,
         "the model is unavailable: no healthy replica of 2; retry shortly"),
    ],
)  # fmt: skip
async def test_runner_faults_become_one_clear_status_each(
    make: Harness, raised: Exception, status: int, message: str
) -> None:
    runner = FakeRunner(fail_with=raised)
    batcher = await make(runner, max_batch_size=2, batch_timeout_ms=LONG_MS)

    outcomes = await asyncio.gather(
        *(settle(batcher.submit(make_rows(1, start=i))) for i in range(2))
    )

    for outcome in outcomes:
        assert isinstance(outcome, ShardServeError)
        assert (outcome.status_code, str(outcome)) == (status, message)
    assert len(runner.batches) == 1  # a replica fault is retried by the runner, not here
