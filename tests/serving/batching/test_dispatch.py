"""When a batch whose wait ran out goes: at once into an idle pipeline, else once the first stage
of a healthy replica is about to be free, when full, or when a member's deadline needs it to go
(``serving.batching.dispatch``); the auto wait's share goes as it is. The pure rule first, then the batcher on a clock the test moves,
with the first stage's compute seeded as the stats poll would report it."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from serving.batching.batcher import Batcher
from serving.batching.dispatch import entry_free_at, pipeline_fit
from tests.fakes import FakeRunner, make_rows, row_ids, spawn
from tests.serving.batching.harness import FakeClock, Harness, occupy, open_gate

# --- the rule


def test_an_idle_pipeline_is_free_at_once() -> None:
    assert entry_free_at([], 1) == -math.inf
    assert pipeline_fit(10.0, [], 1, go_by=math.inf) == (None, "stage_free")


def test_a_busy_first_stage_frees_after_the_batches_sent_to_it() -> None:
    # Sent at 0 and at 1, 3 s each in the first stage: the second waits behind the first.
    assert entry_free_at([(1.0, 3.0), (0.0, 3.0)], 1) == 6.0
    assert pipeline_fit(2.0, [(0.0, 3.0), (1.0, 3.0)], 1, go_by=math.inf) == (6.0, "filling")
    assert pipeline_fit(6.0, [(0.0, 3.0), (1.0, 3.0)], 1, go_by=math.inf) == (None, "stage_free")


def test_a_stage_idle_since_before_the_batch_was_sent_starts_it_when_sent() -> None:
    assert entry_free_at([(0.0, 1.0), (5.0, 1.0)], 1) == 6.0


def test_one_free_replica_is_enough() -> None:
    # Two replicas: one batch in flight leaves the other's first stage free.
    assert entry_free_at([(0.0, 3.0)], 2) == -math.inf
    assert entry_free_at([(0.0, 3.0), (1.0, 5.0)], 2) == 3.0


def test_a_deadline_sends_the_batch_before_the_stage_frees() -> None:
    assert pipeline_fit(2.0, [(0.0, 10.0)], 1, go_by=4.0) == (4.0, "filling")
    assert pipeline_fit(4.0, [(0.0, 10.0)], 1, go_by=4.0) == (None, "deadline")


# --- the batcher


def _seed_entry(batcher: Batcher, ms_per_row: float) -> None:
    """As the stats poll reports it: one stage, a one-row batch takes ``ms_per_row``."""
    batcher.observe_compute(
        [{"stage_index": 0, "compute_by_rows": {1: {"ewma_ms": ms_per_row, "count": 1}}}]
    )


async def test_a_batch_keeps_taking_rows_until_the_stage_frees(
    clock: FakeClock, make: Harness
) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms=5, max_inflight_batches=2)
    _seed_entry(batcher, 60_000)  # the first batch holds the stage for a minute
    busy = await occupy(batcher, runner)
    first = await spawn(batcher.submit(make_rows(1, start=1)))
    clock.advance(1.0)  # its wait ran out long ago; the stage is busy for 59 s more
    second = await spawn(batcher.submit(make_rows(1, start=2)))
    assert (runner.calls_started, batcher.queued_rows) == (1, 2)
    clock.advance(60.0)
    await runner.wait_started(2)
    open_gate(runner)
    await asyncio.gather(busy, first, second)
    assert [row_ids(b) for b in runner.batches] == [[0], [1, 2]]
    assert [(r.size, r.reason) for r in make.records] == [(1, "timeout"), (2, "stage_free")]


async def test_a_filling_batch_goes_when_full(clock: FakeClock, make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=4, batch_timeout_ms=5, max_inflight_batches=2)
    _seed_entry(batcher, 60_000)
    busy = await occupy(batcher, runner)
    first = await spawn(batcher.submit(make_rows(1, start=1)))
    clock.advance(1.0)
    rest = await spawn(batcher.submit(make_rows(3, start=2)))
    await runner.wait_started(2)
    open_gate(runner)
    await asyncio.gather(busy, first, rest)
    assert [(r.size, r.reason) for r in make.records] == [(1, "timeout"), (4, "full")]


async def test_a_members_deadline_sends_the_batch_before_the_stage_frees(
    clock: FakeClock, make: Harness
) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms=5, max_inflight_batches=2)
    _seed_entry(batcher, 10_000)  # a row takes 10 s: the stage frees 10 s after the first
    busy = await occupy(batcher, runner)
    # Its batch must leave 10 s (the predicted run) before its deadline: 5 s from now.
    late = await spawn(batcher.submit(make_rows(1, start=1), deadline=time.monotonic() + 15))
    clock.advance(1.0)
    assert runner.calls_started == 1
    clock.advance(4.5)
    await runner.wait_started(2)
    open_gate(runner)
    await asyncio.gather(busy, late)
    assert [(r.size, r.reason) for r in make.records] == [(1, "timeout"), (1, "deadline")]


async def test_a_filling_batch_goes_as_stage_free_when_the_pipeline_empties(
    clock: FakeClock, make: Harness
) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms=5, max_inflight_batches=2)
    _seed_entry(batcher, 60_000)  # predicted: the stage is busy for a minute
    busy = await occupy(batcher, runner)
    first = await spawn(batcher.submit(make_rows(1, start=1)))
    clock.advance(1.0)  # its wait ran out: it keeps taking rows
    await asyncio.sleep(0.05)
    assert runner.calls_started == 1
    open_gate(runner)  # the batch in flight ends long before its prediction
    await asyncio.gather(busy, first)
    assert [(r.size, r.reason) for r in make.records] == [(1, "timeout"), (1, "stage_free")]


async def test_the_auto_waits_share_goes_while_the_first_stage_is_busy(
    clock: FakeClock, make: Harness
) -> None:
    # Two stages, a row in flight and one queued: two rows over two batches, so the queued row
    # is its batch's share (the auto wait's "target") and goes at once. Held until the first
    # stage freed as well, the batches of 16 clients over 2 stages travelled in step.
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(
        runner, max_batch_size=8, batch_timeout_ms="auto", max_inflight_batches=3,
        pipeline_depth=2, pipeline_stages=2,
    )  # fmt: skip
    _seed_entry(batcher, 60_000)
    busy = await occupy(batcher, runner)
    second = await spawn(batcher.submit(make_rows(1, start=1)))
    await runner.wait_started(2)
    open_gate(runner)
    await asyncio.gather(busy, second)
    assert [(r.size, r.reason) for r in make.records] == [(1, "idle"), (1, "target")]


async def test_an_idle_pipeline_gets_the_batch_at_its_timeout(make: Harness) -> None:
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms=5)
    _seed_entry(batcher, 60_000)
    await batcher.submit(make_rows(1))
    assert [(r.size, r.reason) for r in make.records] == [(1, "timeout")]


async def test_turned_off_a_batch_closes_on_its_wait_alone(clock: FakeClock, make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(
        runner, max_batch_size=8, batch_timeout_ms=5, max_inflight_batches=2, fill_while_busy=False
    )
    _seed_entry(batcher, 60_000)
    busy = await occupy(batcher, runner)
    first = await spawn(batcher.submit(make_rows(1, start=1)))
    clock.advance(1.0)
    await runner.wait_started(2)
    open_gate(runner)
    await asyncio.gather(busy, first)
    assert [(r.size, r.reason) for r in make.records] == [(1, "timeout"), (1, "timeout")]


async def test_without_a_compute_report_the_wait_decides(clock: FakeClock, make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms=5, max_inflight_batches=2)
    busy = await occupy(batcher, runner)
    first = await spawn(batcher.submit(make_rows(1, start=1)))
    clock.advance(1.0)
    await runner.wait_started(2)
    open_gate(runner)
    await asyncio.gather(busy, first)
    assert [r.reason for r in make.records] == ["timeout", "timeout"]


@pytest.mark.parametrize("replicas", [1, 2])
async def test_a_free_replica_takes_the_batch_at_its_timeout(
    clock: FakeClock, make: Harness, replicas: int
) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(
        runner, max_batch_size=8, batch_timeout_ms=5, max_inflight_batches=3,
        pipeline_depth=replicas, pipeline_stages=1,
    )  # fmt: skip
    _seed_entry(batcher, 60_000)
    busy = await occupy(batcher, runner)
    first = await spawn(batcher.submit(make_rows(1, start=1)))
    clock.advance(1.0)
    if replicas == 2:
        await runner.wait_started(2)  # the second replica's first stage is free
    second = await spawn(batcher.submit(make_rows(1, start=2)))
    clock.advance(60.0)
    await runner.wait_started(replicas + 1)
    open_gate(runner)
    await asyncio.gather(busy, first, second)
    reasons = [(r.size, r.reason) for r in make.records]
    if replicas == 1:
        assert reasons == [(1, "timeout"), (2, "stage_free")]
    else:
        assert reasons[:2] == [(1, "timeout"), (1, "timeout")]
