"""``ReplicaSet``'s scaling rules over fake replicas: pure asyncio, no Ray started.

A scale-down takes a replica that does not serve before one that does; a drain that runs past its
timeout kills the replica and its batches are retried on another healthy one (or refused with a
retry hint where none is); a draining replica is never recovered; a start is cancelled by a
scale-down or by its caller, and what it placed is removed. The same on real actors:
test_replica_set_elastic.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

import shards.pipeline.replica_set
from shards.errors import NoHealthyReplicaError, ReplicaLostError
from shards.pipeline.health import ReplicaState
from shards.pipeline.options import PipelineOptions
from shards.pipeline.placement import Layout
from shards.pipeline.replica_set import ReplicaSet
from shards.pipeline.watchdog import Watchdog
from shards.signature import ModelSignature, TensorSpec

SIGNATURE = ModelSignature(
    name="fake",
    inputs=(TensorSpec("x", (2,), "float32"),),
    outputs=(TensorSpec("x", (2,), "float32"),),
)
BATCH = {"x": np.ones((3, 2), np.float32)}


class FakeGroup:
    async def ready(self) -> None:
        return None


class FakeReplica:
    """What ``ReplicaSet`` uses of a ``Replica``: each batch waits for a future of its own
    (``held``) when ``hold`` is set; ``close`` fails the batches still running, as killing actors
    does; its recovery's probe never answers."""

    compiled = None

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = ReplicaState.HEALTHY
        self.inflight = 0
        self.hold = False
        self.held: list[asyncio.Future[None]] = []
        self.ran = 0
        self.closed = threading.Event()
        self.placement_group = FakeGroup()
        self._loop = asyncio.get_running_loop()

    async def run(
        self, inputs: dict[str, np.ndarray], watchdog: Watchdog | None = None
    ) -> dict[str, np.ndarray]:
        self.inflight += 1
        self.ran += 1
        try:
            if self.closed.is_set():
                raise ReplicaLostError("a stage process failed: ActorDiedError")
            if self.hold:
                step = self._loop.create_future()
                self.held.append(step)
                await step
            return {"x": inputs["x"] * 2}
        finally:
            self.inflight -= 1

    async def probe(self, timeout_s: float) -> None:
        await asyncio.Event().wait()

    def kill_actors(self) -> None:
        pass

    def clear_fault(self) -> None:
        pass

    def release(self) -> None:
        for step in self.held:
            if not step.done():
                step.set_result(None)

    def close(self) -> bool:
        def fail_running() -> None:
            for step in self.held:
                if not step.done():
                    step.set_exception(ReplicaLostError("a stage process failed: ActorDiedError"))

        self._loop.call_soon_threadsafe(fail_running)  # called off the loop, in a thread
        self.closed.set()
        return True


def make_group(*states: ReplicaState) -> tuple[ReplicaSet, list[FakeReplica]]:
    fakes = [FakeReplica(f"r{i}") for i in range(len(states))]
    for fake, state in zip(fakes, states, strict=True):
        fake.state = state
    manifest = SimpleNamespace(signature=SIGNATURE, stages=(None,), depth=1)
    layout = Layout((), {}, [], cast(Any, SimpleNamespace(gpus=0.0)), PipelineOptions(), 2)
    return ReplicaSet(cast(Any, manifest), cast(Any, fakes), layout), fakes


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


H, S, D, ST, P = (
    ReplicaState.HEALTHY,
    ReplicaState.SUSPECT,
    ReplicaState.DEAD,
    ReplicaState.STARTING,
    ReplicaState.PENDING,
)


async def test_scale_down_takes_the_replicas_that_do_not_serve_first() -> None:
    group, fakes = make_group(H, H, S, D, ST, P, H)
    fakes[0].inflight = 1  # busier than the other healthy ones: taken last
    taken = []
    try:
        while await group.remove_replica(drain_timeout_s=0):
            taken.append(next(f.name for f in fakes if f.closed.is_set() and f.name not in taken))
        assert group.health().states == ("healthy",)  # never below one replica
    finally:
        await group.close()

    # Pending, starting, dead, suspect; then the idle healthy ones, the newest first.
    assert taken == ["r5", "r4", "r3", "r2", "r6", "r1"]


async def test_a_drain_past_its_timeout_kills_the_replica_and_retries_its_batches(
    caplog: pytest.LogCaptureFixture,
) -> None:
    group, (a, b) = make_group(H, H)
    a.hold = b.hold = True
    try:
        batches = [asyncio.ensure_future(group.run(BATCH)) for _ in range(3)]
        await until(lambda: a.inflight + b.inflight == 3)
        busy, idle = (a, b) if a.inflight == 2 else (b, a)
        busy.hold = False  # the retried batch is answered at once
        assert await group.remove_replica(drain_timeout_s=0.05)
        busy.release()
        answers = await asyncio.gather(*batches)
        health = group.health()
    finally:
        await group.close()

    for out in answers:
        np.testing.assert_array_equal(out["x"], BATCH["x"] * 2)
    assert idle.closed.is_set() and idle.ran == 1 and busy.ran == 3
    assert health.states == ("healthy",) and health.reason == ""  # no fault: never recovered
    assert "1 batch(es) still running after its drain timeout of 0.05 s" in caplog.text


async def test_a_drained_replicas_batch_is_refused_with_retry_after_where_none_serves() -> None:
    group, (a, b) = make_group(H, H)
    a.hold = b.hold = True
    try:
        batches = [asyncio.ensure_future(group.run(BATCH)) for _ in range(2)]
        await until(lambda: a.inflight == b.inflight == 1)
        removing = asyncio.ensure_future(group.remove_replica(drain_timeout_s=0.1))
        await until(lambda: group.health().states == ("healthy", "draining"))  # the newest
        a.close()  # the one left fails meanwhile: its batch and the drained one have nowhere
        results = await asyncio.gather(*batches, return_exceptions=True)
        assert await removing
        health = group.health()
    finally:
        await group.close()

    assert all(isinstance(r, NoHealthyReplicaError) for r in results), results
    assert all(cast(NoHealthyReplicaError, r).retry_after_s >= 1.0 for r in results)
    assert health.states == ("suspect",)  # the drained one is gone, not recovered


def fake_starts(monkeypatch: pytest.MonkeyPatch) -> tuple[list[FakeReplica], asyncio.Event]:
    """``add_replica`` places fakes whose start waits for the event returned."""
    placed: list[FakeReplica] = []
    started = asyncio.Event()

    def new_replica(layout: Layout) -> FakeReplica:
        placed.append(FakeReplica(f"new{len(placed)}"))
        return placed[-1]

    async def start_replica(*args: object) -> None:
        await started.wait()

    monkeypatch.setattr(shards.pipeline.replica_set, "new_replica", new_replica)
    monkeypatch.setattr(shards.pipeline.replica_set, "start_replica", start_replica)
    return placed, started


async def test_a_scale_down_cancels_a_starting_replica_and_its_add_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    placed, started = fake_starts(monkeypatch)
    group, _ = make_group(H)
    try:
        adding = asyncio.ensure_future(group.add_replica(pending_timeout_s=5))
        await until(lambda: group.health().states == ("healthy", "starting"))
        assert await group.remove_replica(drain_timeout_s=5)
        assert not await adding
        assert group.health().states == ("healthy",)
        assert placed[0].closed.is_set()

        started.set()  # the next one starts: in the rotation
        assert await group.add_replica(pending_timeout_s=5)
        assert group.health().states == ("healthy", "healthy")
    finally:
        await group.close()


async def test_a_cancelled_add_removes_what_it_placed(monkeypatch: pytest.MonkeyPatch) -> None:
    placed, _ = fake_starts(monkeypatch)
    group, _ = make_group(H)
    try:
        adding = asyncio.ensure_future(group.add_replica(pending_timeout_s=5))
        await until(lambda: group.replicas == 2)
        adding.cancel()
        with pytest.raises(asyncio.CancelledError):
            await adding
        assert group.health().states == ("healthy",)
        assert placed[0].closed.is_set()
    finally:
        await group.close()
