"""A ReplicaSet growing and shrinking on the session Ray (4 logical CPUs, 0 GPUs) while a steady
stream of batches runs: nothing fails when a replica joins or leaves, a replica that cannot be
placed stays pending (saying what it waits for) and is given up after its timeout, and a stage
killed while a replica starts or drains loses no batch.

Starting a replica is the cost here (seconds on two busy cores): the tests share one set, each
beginning and ending with one healthy replica."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import keras
import numpy as np
import pytest
import pytest_asyncio
import ray

from shards.cluster import pending_placement
from shards.errors import RunError
from shards.partition.cut import partition_to_bundle
from shards.pipeline.replica_set import PipelineOptions, ReplicaSet
from tests.shards.model_zoo import Inputs, call_whole, sequential

Case = tuple[Path, keras.Model, Inputs]
# Small CPU shares: these replicas fit beside other tests' pipelines on the session's 4 CPUs.
OPTIONS = PipelineOptions(batch_sizes=(3,), cpus_per_shard=0.1)
# Each caller's pause between batches: a steady stream that leaves the machine's two cores to
# the actors starting (not a wait for anything).
PACE_S = 0.01
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def seq_case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    model, inputs = sequential()
    bundle = tmp_path_factory.mktemp("seq")
    partition_to_bundle(model, bundle, stages=2)
    return bundle, model, inputs


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def group(ray_address: str, seq_case: Case) -> AsyncIterator[ReplicaSet]:
    replicas = await ReplicaSet.create(seq_case[0], OPTIONS)
    try:
        yield replicas
    finally:
        await replicas.close()


@pytest.fixture
def one(group: ReplicaSet) -> ReplicaSet:
    """The shared set, as every test finds and leaves it: one healthy replica."""
    assert group.health().states == ("healthy",)
    return group


async def until(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class Stream:
    """``clients`` callers sending the same batch, one after another, until stopped; every
    answer is checked, every failure kept."""

    def __init__(self, group: ReplicaSet, case: Case, clients: int = 3) -> None:
        _, model, inputs = case
        self.group, self.inputs = group, inputs
        self.want = call_whole(model, inputs)
        self.answered = 0
        self.failed: list[str] = []
        self._stop = False
        self._tasks = [asyncio.ensure_future(self._client()) for _ in range(clients)]

    async def _client(self) -> None:
        while not self._stop:
            try:
                out = await self.group.run(self.inputs)
            except RunError as error:
                self.failed.append(error.message)
            else:
                close = (np.allclose(out[n], w, atol=1e-5, rtol=0) for n, w in self.want.items())
                if all(close):
                    self.answered += 1
                else:
                    self.failed.append(f"wrong answer: {out}")
            await asyncio.sleep(PACE_S)

    async def more(self, batches: int) -> None:
        """Wait until ``batches`` more have been answered."""
        target = self.answered + batches
        await until(lambda: self.answered >= target)

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)


async def test_a_replica_added_then_removed_under_load_fails_no_batch(
    one: ReplicaSet, seq_case: Case
) -> None:
    stream = Stream(one, seq_case)
    try:
        await stream.more(5)
        adding = asyncio.ensure_future(one.add_replica(pending_timeout_s=30))
        seen: list[tuple[str, ...]] = []
        while not adding.done():
            seen.append(one.health().states)
            await asyncio.sleep(0.005)
        assert await adding
        assert ("healthy", "starting") in seen  # out of the rotation until warm
        assert one.health().states == ("healthy", "healthy") and one.replicas == 2
        await stream.more(30)
        new = max(s["replica"] for s in await one.stats())
        calls = {(s["replica"], s["stage_index"]): s["calls"] for s in await one.stats()}
        assert calls[(new, 0)] > 5  # the new replica serves (its warm batch is one call)

        assert await one.remove_replica(drain_timeout_s=10)
        assert one.health().states == ("healthy",) and one.replicas == 1
        await stream.more(5)
    finally:
        await stream.stop()

    assert stream.failed == []


async def test_a_replica_that_cannot_be_placed_stays_pending_then_is_given_up(
    one: ReplicaSet, seq_case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    # The next replica asks for a node type this cluster lacks (on a `ray up` cluster, the
    # pending demand that makes the autoscaler start one).
    layout = one._layout
    one._layout = dataclasses.replace(
        layout, bundles=[{**b, "tpu_host": 1.0} for b in layout.bundles]
    )
    stream = Stream(one, seq_case)
    try:
        adding = asyncio.ensure_future(one.add_replica(pending_timeout_s=2.0))
        await until(lambda: one.health().pending_reason != "", timeout_s=10)
        health = one.health()
        assert health.states == ("healthy", "pending") and health.healthy == 1
        assert "waiting for resources: placement group of" in health.pending_reason
        assert "tpu_host 0/0 free" in health.pending_reason
        await stream.more(10)  # the other replica serves meanwhile

        assert not await adding
        health = one.health()
        assert health.states == ("healthy",) and health.pending_reason == ""
        assert pending_placement() is None  # its placement group was removed
        await stream.more(5)
    finally:
        one._layout = layout
        await stream.stop()

    assert stream.failed == []
    assert "given up: pending for 2 s (its pending timeout), waiting for resources" in caplog.text
    assert "tpu_host 0/0 free" in caplog.text


async def test_a_stage_killed_while_its_replica_starts_loses_no_batch(
    one: ReplicaSet, seq_case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    stream = Stream(one, seq_case)
    try:
        adding = asyncio.ensure_future(one.add_replica(pending_timeout_s=30))
        await until(lambda: one.replicas == 2)
        new = max(one._replicas)
        await until(lambda: len(one._replicas[new].actors) == 2)  # spawned, loading
        ray.kill(one._replicas[new].actors[1])
        assert not await adding  # given up; the caller may ask again later
        assert one.health().states == ("healthy",)
        await stream.more(5)
    finally:
        await stream.stop()

    assert stream.failed == []
    assert f"replica {new} given up: shard actor for stage 1 of replica {new}" in caplog.text


async def test_a_stage_killed_while_its_replica_drains_loses_no_batch(
    one: ReplicaSet, seq_case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    assert await one.add_replica(pending_timeout_s=30)
    before = one.health()
    ids = sorted({i["replica"] for i in await one.describe()})
    pids = {(i["replica"], i["stage_index"]): i["pid"] for i in await one.describe()}
    stream = Stream(one, seq_case, clients=4)
    try:
        await stream.more(5)
        # Stopped, the last stages hold every batch given to either replica: the one drained
        # surely has batches in flight when its stage dies.
        for replica in ids:
            os.kill(pids[(replica, 1)], signal.SIGSTOP)
        await until(lambda: min(one.inflight) >= 2)
        removing = asyncio.ensure_future(one.remove_replica(drain_timeout_s=30))
        await until(lambda: "draining" in one.health().states)
        position = one.health().states.index("draining")
        held = one.inflight[position]
        gone, kept = ids[position], ids[1 - position]
        os.kill(pids[(gone, 1)], signal.SIGKILL)
        os.kill(pids[(kept, 1)], signal.SIGCONT)
        assert await removing
        after = one.health()
        assert after.states == ("healthy",)
        await stream.more(10)
    finally:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        await stream.stop()

    assert held >= 2
    assert stream.failed == []
    # A draining replica's fault takes nothing out of the rotation and is never recovered.
    assert "leaves the rotation" not in caplog.text
    assert (after.rebuilds, after.recoveries) == (before.rebuilds, before.recoveries)
