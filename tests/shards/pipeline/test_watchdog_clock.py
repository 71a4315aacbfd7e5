"""The watchdog's clock on one replica (``shards.pipeline.replica.Replica``) over a fake compiled graph:
pure asyncio, no Ray started. A batch is timed from when its first stage starts it, so time it
queued behind other batches never counts against it."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import numpy as np
import pytest

from shards.errors import ReplicaLostError, StageTimeoutError
from shards.pipeline.replica import Replica
from shards.pipeline.watchdog import Watchdog

LIMIT_S = 0.05  # a 1-row batch's limit; a 2-row batch's is 10 s


class FakeGraph:
    """``CompiledStages.run``'s shape: ``capacity`` batches inside at once; each batch answers
    when its ``hold`` (one per batch, in order) is done."""

    def __init__(self, capacity: int, holds: list[asyncio.Future[None]]) -> None:
        self._places = asyncio.Semaphore(capacity)
        self._holds = holds

    async def run(self, inputs: dict[str, np.ndarray], entered: Any = None) -> dict[str, Any]:
        async with self._places:
            entered()
            await self._holds.pop(0)
            return {}


def replica(capacity: int, *holds: asyncio.Future[None]) -> Replica:
    pipeline = Replica([], (), {}, cast(Any, None))
    pipeline.compiled = cast(Any, FakeGraph(capacity, list(holds)))
    return pipeline


def watchdog() -> Watchdog:
    dog = Watchdog(factor=1.0, floor_s=LIMIT_S, min_samples=1)
    dog.observe(1, 0.001)
    dog.observe(2, 10.0)
    return dog


def rows(n: int) -> dict[str, np.ndarray]:
    return {"x": np.zeros((n, 4), np.float32)}


def later(seconds: float) -> asyncio.Future[None]:
    """Done ``seconds`` from now: a batch that holds its stage that long."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.call_later(seconds, done.set_result, None)
    return done


def after(first: asyncio.Future[None]) -> asyncio.Future[None]:
    """Done when ``first`` is: a batch that was computed while the one ahead held the stage."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    first.add_done_callback(lambda _: done.set_result(None))
    return done


@pytest.mark.parametrize("capacity", [1, 2])
async def test_a_batch_queued_past_its_limit_behind_another_is_not_abandoned(
    capacity: int,
) -> None:
    # capacity 1: the 1-row batch waits for a place in the graph (its semaphore); capacity 2:
    # inside the graph, behind the 2-row batch in the stages.
    ahead = later(4 * LIMIT_S)
    pipeline, dog = replica(capacity, ahead, after(ahead)), watchdog()

    answers = await asyncio.gather(pipeline.run(rows(2), dog), pipeline.run(rows(1), dog))

    assert answers == [{}, {}]


async def test_a_batch_running_past_its_limit_from_its_start_is_abandoned() -> None:
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    pipeline = replica(1, never)

    with pytest.raises(StageTimeoutError, match=r"watchdog's limit of 0\.05 s"):
        await asyncio.wait_for(pipeline.run(rows(1), watchdog()), 5.0)


async def test_the_clock_of_the_next_batch_starts_when_the_one_ahead_ends() -> None:
    # The 2-row batch ends (its hold) well past the 1-row batch's limit; from then on the
    # 1-row batch has its own limit to run in, and it holds longer than that.
    ahead = later(4 * LIMIT_S)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    pipeline, dog = replica(2, ahead, never), watchdog()
    loop = asyncio.get_running_loop()
    started = loop.time()

    first, second = await asyncio.gather(
        pipeline.run(rows(2), dog), pipeline.run(rows(1), dog), return_exceptions=True
    )

    assert first == {}
    assert isinstance(second, StageTimeoutError)
    assert loop.time() - started >= 5 * LIMIT_S


async def test_a_completed_batch_is_observed_by_its_size() -> None:
    pipeline, dog = replica(1, later(0.001)), Watchdog(min_samples=1, floor_s=0.0, factor=1.0)

    await pipeline.run(rows(3), dog)

    assert 0.0 < dog.limit_s(3) < 1.0
    assert dog.limit_s(3) == pytest.approx(dog.limit_s(6) / 2)  # scaled from the size seen


async def test_abandon_ends_the_batches_in_a_closed_graph_at_once_as_lost() -> None:
    # A stage actor died: the compiled graph is closed, and its batches would wait for the
    # watchdog (10 s for the 2-row one) without ``abandon``.
    loop = asyncio.get_running_loop()
    never: list[asyncio.Future[None]] = [loop.create_future(), loop.create_future()]
    pipeline, dog = replica(2, *never), watchdog()
    batches = [asyncio.ensure_future(pipeline.run(rows(2), dog)) for _ in range(2)]
    await asyncio.sleep(0.01)

    pipeline.abandon("a stage process failed: ActorUnavailableError")
    errors = await asyncio.gather(*batches, return_exceptions=True)

    assert [type(e) for e in errors] == [ReplicaLostError] * 2
    assert [e.victim for e in errors] == [False, True]  # type: ignore[union-attr]
    assert errors[0].message == (  # type: ignore[union-attr]
        "a stage process failed: ActorUnavailableError (its compiled graph closed with it)"
    )
