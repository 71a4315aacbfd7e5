"""Rows held while the model's only replica is brought back (``serving.batching.hold``): lost
batches wait ahead of the queue (not counted against ``max_queue_rows``) and run again once it is
back, the suspect first and alone; a suspect lost twice fails alone; requests keep queueing, and
one that cannot wait (its deadline, a failed recovery) gets a 503 with ``Retry-After``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from serving.batching.batcher import Batcher
from serving.errors import BatchFailedError, NotReadyError, QueueFullError
from shards.errors import ReplicaRecoveringError
from tests.fakes import expected_outputs, make_rows, row_ids, settle, spawn
from tests.serving.batching.harness import Harness, assert_rows

RECOVERY_S = 10.0  # how long the last recovery took: the hold's estimate


class OneReplica:
    """The runner's side of a replica that dies under the batches in flight: ``kill`` fails
    them as ``ReplicaSet`` does (the oldest the suspect), and every batch that comes while it is
    down is handed back; ``back`` is done when it rejoins."""

    def __init__(self) -> None:
        self.back: asyncio.Future[str | None] | None = None
        self.ran: list[list[int]] = []  # the row ids of each batch, in the order they ran
        self._running: list[asyncio.Future[None]] = []
        self.kill_next = False  # the next batch that runs kills the replica again

    @property
    def down(self) -> bool:
        return self.back is not None and not self.back.done()

    async def run_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.down:
            raise self._held(suspect=False)
        self.ran.append(row_ids(inputs))
        if self.kill_next:
            self.kill_next = False
            self.back = asyncio.get_running_loop().create_future()
            raise self._held(suspect=True)
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._running.append(gate)
        suspect = await gate
        if suspect is not None:
            raise self._held(suspect=bool(suspect))
        return expected_outputs(inputs)

    def answer_running(self) -> None:
        for gate in self._running:
            if not gate.done():
                gate.set_result(None)

    def kill(self) -> None:
        self.back = asyncio.get_running_loop().create_future()
        for i, gate in enumerate(self._running):
            if not gate.done():
                gate.set_result(i == 0)  # type: ignore[arg-type]
        self._running.clear()

    def rejoin(self, why: str | None = None) -> None:
        assert self.back is not None
        self.back.set_result(why)

    def _held(self, suspect: bool) -> ReplicaRecoveringError:
        return ReplicaRecoveringError(
            "no healthy replica of 1 (last fault: a stage process failed: ActorDiedError)",
            RECOVERY_S,
            back=self.back,
            suspect=suspect,
        )


async def until(check: object, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # type: ignore[operator]
            await asyncio.sleep(0.001)


async def two_batches_lost(make: Harness) -> tuple[Batcher, OneReplica, list[asyncio.Task]]:
    """Batches [0, 1] and [2, 3] in flight on the replica when it dies, [0, 1] the oldest."""
    replica = OneReplica()
    batcher = await make(
        replica.run_batch, max_batch_size=2, max_inflight_batches=2, max_queue_rows=4,
        batch_timeout_ms=60_000.0,
    )  # fmt: skip
    first = [await spawn(batcher.submit(make_rows(1, start=i))) for i in range(4)]
    await until(lambda: len(replica.ran) == 2)
    replica.kill()
    await until(lambda: batcher.held_rows == 4)
    return batcher, replica, first


async def test_lost_batches_are_held_apart_from_the_queue_then_run_first_suspect_alone(
    make: Harness,
) -> None:
    batcher, replica, first = await two_batches_lost(make)
    # Requests keep queueing meanwhile, up to max_queue_rows on top of the held rows.
    later = [await spawn(batcher.submit(make_rows(1, start=10 + i))) for i in range(4)]
    assert (batcher.held_rows, batcher.queued_rows) == (4, 4)
    full = await settle(batcher.submit(make_rows(1, start=20)))
    assert isinstance(full, QueueFullError)  # 503: the queue is full
    await asyncio.sleep(0.01)
    assert replica.ran == [[0, 1], [2, 3]]  # nothing is sent while the replica is down

    replica.rejoin()
    await until(lambda: len(replica.ran) == 3)
    await asyncio.sleep(0.01)
    assert replica.ran[2] == [0, 1]  # the suspect, alone: nothing else was sent with it
    replica.answer_running()
    await until(lambda: len(replica.ran) == 5)
    assert replica.ran[3] == [2, 3]  # then the held batch, ahead of the queue
    while not all(t.done() for t in [*first, *later]):
        replica.answer_running()
        await asyncio.sleep(0.001)

    for i, task in enumerate(first):
        assert_rows(task.result(), make_rows(1, start=i))
    for i, task in enumerate(later):
        assert_rows(task.result(), make_rows(1, start=10 + i))
    assert batcher.held_rows == 0


async def test_a_suspect_lost_again_fails_alone_and_the_rest_are_answered(
    make: Harness,
) -> None:
    _, replica, first = await two_batches_lost(make)
    replica.kill_next = True  # the suspect's retry kills the replica again

    replica.rejoin()
    await until(lambda: first[0].done())
    assert [type(await settle(t)) for t in first[:2]] == [BatchFailedError] * 2
    assert "lost twice" in first[0].exception().message  # type: ignore[union-attr]
    replica.rejoin()  # back again: the batch behind it runs
    while not all(t.done() for t in first[2:]):
        replica.answer_running()
        await asyncio.sleep(0.001)

    for i in (2, 3):
        assert_rows(first[i].result(), make_rows(1, start=i))
    assert replica.ran == [[0, 1], [2, 3], [0, 1], [2, 3]]


async def test_a_request_that_cannot_wait_for_the_replica_gets_503_with_retry_after(
    make: Harness,
) -> None:
    loop = asyncio.get_running_loop()
    batcher, replica, first = await two_batches_lost(make)

    soon = await settle(batcher.submit(make_rows(1, start=9), deadline=loop.time() + 1.0))
    assert isinstance(soon, NotReadyError) and soon.status_code == 503
    assert "after this request's deadline" in soon.message
    assert soon.retry_after_s is not None and 1.0 <= soon.retry_after_s <= RECOVERY_S
    patient = await spawn(batcher.submit(make_rows(2, start=7), deadline=loop.time() + 60.0))
    assert not patient.done()

    replica.rejoin()
    while not all(t.done() for t in [*first, patient]):
        replica.answer_running()
        await asyncio.sleep(0.001)
    assert_rows(patient.result(), make_rows(2, start=7))


async def test_a_failed_recovery_answers_the_held_rows_with_503(make: Harness) -> None:
    batcher, replica, first = await two_batches_lost(make)

    replica.rejoin("its recovery failed: RuntimeError: no node has room")

    errors = [await settle(t) for t in first]
    assert [type(e) for e in errors] == [NotReadyError] * 4
    assert errors[0].message == (  # type: ignore[union-attr]
        "the model is unavailable: its recovery failed: RuntimeError: no node has room"
    )
    assert all(e.retry_after_s == RECOVERY_S for e in errors)  # type: ignore[union-attr]
    assert batcher.held_rows == 0


@pytest.mark.parametrize("drain", [True, False])
async def test_stop_answers_held_rows(make: Harness, drain: bool) -> None:
    batcher, replica, first = await two_batches_lost(make)

    stopping = asyncio.ensure_future(batcher.stop(drain=drain))
    if drain:  # a drain waits for the replica: the held rows are answered
        await asyncio.sleep(0.01)
        assert not stopping.done()
        replica.rejoin()
        while not stopping.done():
            replica.answer_running()
            await asyncio.sleep(0.001)
        assert [bool(t.exception()) for t in first] == [False] * 4
    else:
        await stopping
        assert [type(t.exception()) for t in first] == [NotReadyError] * 4
