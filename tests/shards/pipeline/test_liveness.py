"""When the watchdog fires, each stage actor is asked whether it is alive (real Ray actors on the
session's Ray; the batch itself runs in a fake graph that never answers): a dead stage makes the
batch lost (``ReplicaLostError``, held and retried), one that is alive and busy makes it hung
(``StageTimeoutError``, 504, not rerun)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest
import ray

from shards.errors import ReplicaLostError, StageTimeoutError
from shards.pipeline.faults import is_replica_fault
from shards.pipeline.replica import Replica
from shards.pipeline.watchdog import Watchdog


@ray.remote(num_cpus=0, max_concurrency=1)
class Stage:
    def info(self) -> dict[str, Any]:
        return {}

    def block(self, seconds: float) -> None:
        time.sleep(seconds)  # holds the actor's one thread, as a batch that hangs does


class NeverAnswers:
    """``CompiledStages.run``'s shape: the batch enters and never comes back."""

    async def run(self, inputs: dict[str, np.ndarray], entered: Any = None) -> dict[str, Any]:
        entered()
        await asyncio.get_running_loop().create_future()
        return {}


@pytest.fixture
def actors(ray_address: str) -> Iterator[list[Any]]:
    started = [Stage.remote(), Stage.remote()]  # type: ignore[attr-defined]
    ray.get([a.info.remote() for a in started])
    yield started
    for actor in started:
        ray.kill(actor, no_restart=True)


def run_past_the_watchdog(actors: list[Any]) -> BaseException:
    pipeline = Replica(actors, (), {}, cast(Any, None))
    pipeline.compiled = cast(Any, NeverAnswers())
    batch = {"x": np.zeros((1, 4), np.float32)}

    async def run() -> BaseException:
        try:
            await asyncio.wait_for(pipeline.run(batch, Watchdog(0.05)), 30)
        except BaseException as exc:
            return exc
        raise AssertionError("a batch that never answers was answered")

    return asyncio.run(run())


def test_a_dead_stage_found_when_the_watchdog_fires_makes_the_batch_lost_not_hung(
    actors: list[Any],
) -> None:
    ray.kill(actors[1], no_restart=True)

    error = run_past_the_watchdog(actors)

    assert isinstance(error, ReplicaLostError), error
    assert is_replica_fault(error)
    assert error.message == (
        "a stage process failed: ActorDiedError (the batch ran past the watchdog's limit of 0.05 s)"
    )


def test_a_stage_alive_but_busy_when_the_watchdog_fires_makes_the_batch_hung(
    actors: list[Any],
) -> None:
    actors[1].block.remote(60.0)  # alive, but it cannot answer within the probe's second

    error = run_past_the_watchdog(actors)

    assert isinstance(error, StageTimeoutError), error
    assert error.message == "the batch ran past the watchdog's limit of 0.05 s"
