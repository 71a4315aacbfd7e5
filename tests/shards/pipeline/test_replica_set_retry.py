"""``ReplicaSet.run``'s retry rules over fake replicas: pure asyncio, no Ray started.

A replica fault is retried once on another healthy replica; a batch that only waited behind the
cause (a victim) is retried without counting; where no other replica is healthy the batch that
hung gets its ``StageTimeoutError``, every other one a ``ReplicaRecoveringError`` whose ``back``
is done when the replica rejoins (the batcher holds the rows until then), the batch that was
oldest when a stage died marked ``suspect``; once a rebuild fails, batches are refused with a
``NoHealthyReplicaError`` that says when to try again; a close during a recovery ends it; a
recovery that raises past its own handling is logged, counted and its replica marked dead.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from shards.errors import (
    ModelError,
    NoHealthyReplicaError,
    ReplicaLostError,
    ReplicaRecoveringError,
    RunError,
    StageTimeoutError,
)
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
START_S = 30.0  # how long the fake group took to start: a refusal's first retry hint

Step = BaseException | asyncio.Future[BaseException | None] | None


class Script:
    """What the batches meet, in the order they run, on whichever replica they run."""

    def __init__(self, *steps: Step) -> None:
        self.steps = list(steps)
        self.ran_on: list[str] = []

    def next(self, replica: str) -> Step:
        self.ran_on.append(replica)
        return self.steps.pop(0) if self.steps else None


class FakeReplica:
    """What ``ReplicaSet`` uses of ``shards.pipeline.replica.Replica``. Its recovery's probe waits
    for ``recovered``; ``close`` fails the batches still running, as killing actors does."""

    compiled = None

    def __init__(self, name: str, script: Script) -> None:
        self.name = name
        self.script = script
        self.state = ReplicaState.HEALTHY
        self.inflight = 0
        self.recovered = asyncio.Event()
        self.closed = threading.Event()
        self._running: list[asyncio.Future[BaseException | None]] = []
        self._loop = asyncio.get_running_loop()

    async def run(
        self, inputs: dict[str, np.ndarray], watchdog: Watchdog | None = None
    ) -> dict[str, np.ndarray]:
        self.inflight += 1
        try:
            step = self.script.next(self.name)
            if isinstance(step, asyncio.Future):
                self._running.append(step)
                step = await step
            if isinstance(step, BaseException):
                raise step
            return {"x": inputs["x"] * 2}
        finally:
            self.inflight -= 1

    async def probe(self, timeout_s: float) -> None:
        await self.recovered.wait()

    def kill_actors(self) -> None:
        pass

    def clear_fault(self) -> None:
        pass

    def close(self) -> bool:
        def fail_running() -> None:
            for step in self._running:
                if not step.done():
                    step.set_result(lost())

        self._loop.call_soon_threadsafe(fail_running)  # called off the loop, in a thread
        self.closed.set()
        return True


def assert_answered(out: dict[str, np.ndarray]) -> None:
    np.testing.assert_array_equal(out["x"], BATCH["x"] * 2)


def lost(victim: bool = False) -> ReplicaLostError:
    error = ReplicaLostError("a stage process failed: ActorDiedError")
    error.victim = victim
    return error


def hung() -> StageTimeoutError:
    return StageTimeoutError("the batch ran past the watchdog's limit of 5 s")


def make_group(script: Script, replicas: int = 1) -> tuple[ReplicaSet, list[FakeReplica]]:
    fakes = [FakeReplica(f"r{i}", script) for i in range(replicas)]
    manifest = SimpleNamespace(signature=SIGNATURE, stages=(None,), depth=1)
    layout = Layout((), {}, [], cast(Any, SimpleNamespace(gpus=0.0)), PipelineOptions(), 2)
    group = ReplicaSet(cast(Any, manifest), cast(Any, fakes), layout, start_s=START_S)
    return group, fakes


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def pending() -> asyncio.Future[BaseException | None]:
    return asyncio.get_running_loop().create_future()


async def test_one_replica_a_hung_batch_fails_at_once_and_is_not_retried() -> None:
    script = Script(hung())
    group, (replica,) = make_group(script)
    try:
        with pytest.raises(StageTimeoutError, match="watchdog's limit of 5 s"):
            await group.run(BATCH)
        # While it recovers, a batch is handed back at once to wait for it, told how long.
        with pytest.raises(ReplicaRecoveringError) as refused:
            await group.run(BATCH)
        assert script.ran_on == ["r0"]  # neither the hung batch nor the next one ran again
        assert group.health().states == ("suspect",)
        assert group.health().recovering
        assert "no healthy replica of 1 (last fault: the batch ran past" in refused.value.message
        assert START_S - 1 <= refused.value.retry_after_s <= START_S
        assert not refused.value.suspect
        back = refused.value.back
        assert back is not None and not back.done()

        replica.recovered.set()
        assert await asyncio.wait_for(back, 10) is None  # done when the replica rejoins
        assert group.health().healthy == 1
        assert_answered(await group.run(BATCH))
        assert group.health().recoveries == 1
    finally:
        await group.close()


async def test_one_replica_the_batches_behind_a_hung_one_wait_for_the_restart() -> None:
    first, second = pending(), pending()
    script = Script(first, second)
    group, _ = make_group(script)
    try:
        tasks = [asyncio.ensure_future(group.run(BATCH)) for _ in range(2)]
        await until(lambda: len(script.ran_on) == 2)  # both in flight on the one replica
        first.set_result(hung())
        second.set_result(lost(victim=True))  # its stages were killed to stop the first
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await group.close()

    assert isinstance(results[0], StageTimeoutError)  # the batch that hung: 504, not rerun
    assert isinstance(results[1], ReplicaRecoveringError)  # behind it: held for the restart
    assert not results[1].suspect
    assert results[1].retry_after_s >= 1.0
    assert script.ran_on == ["r0", "r0"]


async def test_one_replica_a_batch_lost_with_a_dead_stage_waits_for_it_as_the_suspect() -> None:
    first, second = pending(), pending()
    script = Script(first, second)
    group, (replica,) = make_group(script)
    try:
        tasks = [asyncio.ensure_future(group.run(BATCH)) for _ in range(2)]
        await until(lambda: len(script.ran_on) == 2)
        first.set_result(lost())  # the oldest on the replica when its stage died
        second.set_result(lost(victim=True))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert [type(r) for r in results] == [ReplicaRecoveringError] * 2
        assert [r.suspect for r in results] == [True, False]  # type: ignore[union-attr]
        assert "a stage process failed" in results[0].message  # type: ignore[union-attr]
        assert START_S - 1 <= results[0].retry_after_s <= START_S  # type: ignore[union-attr]
        back = results[0].back  # type: ignore[union-attr]
        assert back is not None and back is results[1].back  # type: ignore[union-attr]

        replica.recovered.set()
        assert await asyncio.wait_for(back, 10) is None
        assert_answered(await group.run(BATCH))  # what the batcher does with the held rows
    finally:
        await group.close()

    assert script.ran_on == ["r0"] * 4  # the two lost, the recovery's warm batch, the rerun


async def test_a_failed_rebuild_releases_the_held_batches_and_refuses_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def unreachable(timeout_s: float) -> None:
        raise ReplicaLostError("the actor is gone for good")

    async def fails(*args: Any) -> None:
        raise RuntimeError("no node has room")

    monkeypatch.setattr("shards.pipeline.recovery.rebuild", fails)
    group, (replica,) = make_group(Script(lost()))
    monkeypatch.setattr(replica, "probe", unreachable)
    try:
        with pytest.raises(ReplicaRecoveringError) as held:
            await group.run(BATCH)
        back = held.value.back
        assert back is not None
        why = await asyncio.wait_for(back, 10)
        assert why == "its recovery failed: RuntimeError: no node has room"
        assert not group.health().recovering
        with pytest.raises(NoHealthyReplicaError) as refused:
            await group.run(BATCH)
        assert not isinstance(refused.value, ReplicaRecoveringError)
    finally:
        await group.close()


async def test_a_replica_fault_is_retried_once_on_another_replica() -> None:
    script = Script(lost())
    group, _ = make_group(script, replicas=2)
    try:
        assert_answered(await group.run(BATCH))
        assert sorted(group.health().states) == ["healthy", "suspect"]
    finally:
        await group.close()

    assert len(set(script.ran_on)) == 2  # the retry went to the other replica


async def test_a_batch_that_caused_two_faults_is_not_given_a_third_replica() -> None:
    script = Script(hung(), hung())
    group, _ = make_group(script, replicas=3)
    try:
        with pytest.raises(StageTimeoutError, match="on two replicas"):
            await group.run(BATCH)
        assert group.health().healthy == 1
    finally:
        await group.close()

    assert len(script.ran_on) == 2


async def test_a_victim_is_retried_without_counting_against_its_batch() -> None:
    # Lost behind another batch on r_a, then the cause on r_b: one counted try, so r_c answers.
    script = Script(lost(victim=True), lost())
    group, _ = make_group(script, replicas=3)
    try:
        assert_answered(await group.run(BATCH))
    finally:
        await group.close()

    assert len(script.ran_on) == 3 and len(set(script.ran_on)) == 3


async def test_the_models_own_error_leaves_the_replica_in() -> None:
    script = Script(ModelError("InvalidArgumentError: bad index", input_blamed=True))
    group, _ = make_group(script, replicas=2)
    try:
        with pytest.raises(ModelError):
            await group.run(BATCH)
        assert group.health().healthy == 2
    finally:
        await group.close()

    assert len(script.ran_on) == 1


async def test_close_during_a_recovery_ends_it_and_fails_the_batches_still_running() -> None:
    running = pending()
    script = Script(lost(), running)
    group, fakes = make_group(script, replicas=2)
    # r_a is lost and recovering (its probe never answers); the batch is retried on r_b and held.
    batch = asyncio.ensure_future(group.run(BATCH))
    await until(lambda: len(script.ran_on) == 2)
    assert sorted(group.health().states) == ["healthy", "suspect"]

    await asyncio.wait_for(group.close(), 10)

    with pytest.raises(RunError) as failed:
        await asyncio.wait_for(batch, 10)
    assert isinstance(failed.value, NoHealthyReplicaError)
    assert "shut down" in failed.value.message
    assert all(f.closed.is_set() for f in fakes)
    with pytest.raises(NoHealthyReplicaError, match="shut down"):
        await group.run(BATCH)


async def test_a_recovery_that_raises_is_logged_counted_and_its_replica_marked_dead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="shardserve")
    group, (replica,) = make_group(Script(hung()))
    counted: list[str] = []
    group.task_errors.append(counted.append)

    def kill_fails() -> None:
        raise RuntimeError("the actor table is locked")

    monkeypatch.setattr(replica, "kill_actors", kill_fails)  # raises past recover's own handling
    try:
        with pytest.raises(StageTimeoutError):
            await group.run(BATCH)
        await until(lambda: counted == ["recovery"])
        logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(logged) == 1 and logged[0].exc_info is not None  # once, with its traceback
        assert logged[0].getMessage() == (
            "replica 0: its recovery failed (RuntimeError: the actor table is locked); "
            "it stays out of the rotation"
        )
        health = group.health()
        assert health.states == ("dead",) and not health.recovering
        # Refused at once with the reason, not held for a recovery that no longer runs.
        with pytest.raises(NoHealthyReplicaError) as refused:
            await group.run(BATCH)
        assert not isinstance(refused.value, ReplicaRecoveringError)
        assert "the actor table is locked" in refused.value.message
    finally:
        await group.close()
