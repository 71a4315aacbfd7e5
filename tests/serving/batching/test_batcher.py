"""The dynamic batcher against the fake runner. Timing-dependent steps are gated with events (the
runner's gate and its call-started events) or run on a clock the test moves (``clock``); no test
sleeps to decide an outcome, and no outcome depends on how fast a loaded machine runs."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from serving.batching.batcher import LOOP_MAX_RESTARTS, Batcher, BatchSettings
from serving.errors import (
    BatchFailedError,
    DeadlineExceededError,
    InvalidInputError,
    NotReadyError,
    QueueFullError,
)
from tests.fakes import FakeRunner, make_rows, row_ids, settle, spawn
from tests.serving.batching.harness import (
    LONG_MS,
    FakeClock,
    Harness,
    assert_rows,
    buggy_wait,
    occupy,
    open_gate,
    seed,
)


async def test_batch_closes_when_full(make: Harness) -> None:
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=4, batch_timeout_ms=LONG_MS)
    inputs = [make_rows(1, start=i) for i in range(4)]
    results = await asyncio.gather(*(batcher.submit(x) for x in inputs))
    assert [row_ids(b) for b in runner.batches] == [[0, 1, 2, 3]]
    assert [(r.size, r.reason, r.ok) for r in make.records] == [(4, "full", True)]
    for result, x in zip(results, inputs, strict=True):
        assert_rows(result, x)


async def test_lone_row_goes_on_timeout(make: Harness) -> None:
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms=20)
    x = make_rows(1, start=7)
    assert_rows(await batcher.submit(x), x)
    assert [(r.size, r.padded_size, r.reason) for r in make.records] == [(1, 1, "timeout")]
    assert make.records[0].queue_wait_s >= 0.019  # the timer runs from arrival (float slack)


async def test_timeout_runs_from_the_first_row_not_the_last(
    clock: FakeClock, make: Harness
) -> None:
    # Rows keep arriving faster than the timeout: a timer restarted by every arrival would only
    # fire 10 s after the last one.
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=64, batch_timeout_ms=10_000)
    tasks = []
    for i in range(10):
        if i:
            clock.advance(1.0)
        tasks.append(await spawn(batcher.submit(make_rows(1, start=i))))
    assert runner.calls_started == 0  # 9 s after the first row
    clock.advance(1.5)  # 10.5 s after the first row, 1.5 s after the last
    await runner.wait_started(1)
    await asyncio.gather(*tasks)
    assert [(r.size, r.reason) for r in make.records] == [(10, "timeout")]
    assert make.records[0].queue_wait_s >= 10.0
    assert row_ids(runner.batches[0])[:10] == list(range(10))  # then padding


async def test_large_request_is_split_and_reassembled_in_order(make: Harness) -> None:
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=4, batch_timeout_ms=0)
    x = make_rows(10)
    assert_rows(await batcher.submit(x), x)
    assert [row_ids(b) for b in runner.batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


async def test_requests_straddle_batches_so_that_batches_fill(make: Harness) -> None:
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=4, batch_timeout_ms=20)
    a, b = make_rows(3, start=0), make_rows(3, start=3)
    result_a, result_b = await asyncio.gather(batcher.submit(a), batcher.submit(b))
    assert [row_ids(batch) for batch in runner.batches] == [[0, 1, 2, 3], [4, 5]]
    assert [r.reason for r in make.records] == ["full", "timeout"]
    assert_rows(result_a, a)
    assert_rows(result_b, b)


async def test_inflight_cap_holds_and_the_next_batch_fills(make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=2, batch_timeout_ms=0, max_inflight_batches=2)
    first = [await spawn(batcher.submit(make_rows(1, start=i))) for i in range(2)]
    await runner.wait_started(2)
    later = [await spawn(batcher.submit(make_rows(1, start=i))) for i in range(2, 5)]
    assert (runner.calls_started, batcher.inflight_batches, batcher.queued_rows) == (2, 2, 3)
    open_gate(runner)
    await asyncio.gather(*first, *later)
    assert runner.max_running == 2
    assert [row_ids(b)[: r.size] for b, r in zip(runner.batches, make.records, strict=True)] == [
        [0],
        [1],
        [2, 3],
        [4],
    ]


async def test_queue_full_is_rejected_at_once(make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=2, max_queue_rows=4, batch_timeout_ms=0)
    busy = await occupy(batcher, runner)
    queued = await spawn(batcher.submit(make_rows(4, start=1)))
    with pytest.raises(QueueFullError) as info:
        await batcher.submit(make_rows(1, start=5))
    assert info.value.retry_after_s >= 1
    assert "4 rows queued" in str(info.value)
    with pytest.raises(InvalidInputError, match="request has 5 rows; at most 4"):
        await batcher.submit(make_rows(5))
    assert make.rejects == ["queue_full"]
    open_gate(runner)
    await asyncio.gather(busy, queued)


async def test_deadline_in_the_queue_fails_and_rows_are_never_computed(
    clock: FakeClock, make: Harness
) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=4, batch_timeout_ms=0)
    busy = await occupy(batcher, runner)
    late = await spawn(batcher.submit(make_rows(2, start=100), deadline=time.monotonic() + 60))
    assert (batcher.queued_rows, late.done()) == (2, False)
    clock.advance(60)
    # The gate is still closed: the error comes at the deadline, not when a slot frees.
    with pytest.raises(DeadlineExceededError, match="in the queue"):
        await late
    assert batcher.queued_rows == 0
    open_gate(runner)
    await busy
    assert_rows(await batcher.submit(make_rows(1, start=5)), make_rows(1, start=5))
    assert [row_ids(b) for b in runner.batches] == [[0], [5]]
    assert make.rejects == ["deadline"]


async def test_deadline_while_computing_fails_at_the_deadline(
    clock: FakeClock, make: Harness
) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=4, batch_timeout_ms=0)
    task = await spawn(batcher.submit(make_rows(1), deadline=time.monotonic() + 60))
    await runner.wait_started(1)
    assert not task.done()
    clock.advance(60)
    with pytest.raises(DeadlineExceededError, match="being computed"):
        await task
    assert runner.calls_finished == 0


async def test_past_deadline_is_rejected_before_queueing(make: Harness) -> None:
    runner = FakeRunner()
    batcher = await make(runner, batch_timeout_ms=0)
    with pytest.raises(DeadlineExceededError):
        await batcher.submit(make_rows(1), deadline=time.monotonic() - 1)
    assert runner.batches == []


async def test_cancelled_request_rows_are_never_computed(make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=4, batch_timeout_ms=0)
    busy = await occupy(batcher, runner)
    gone = await spawn(batcher.submit(make_rows(3, start=100)))
    kept = await spawn(batcher.submit(make_rows(1, start=7)))
    gone.cancel()
    assert isinstance(await settle(gone), asyncio.CancelledError)
    assert batcher.queued_rows == 1
    open_gate(runner)
    await asyncio.gather(busy, kept)
    assert [row_ids(b) for b in runner.batches] == [[0], [7]]
    assert make.rejects == ["cancelled"]


async def test_a_cancel_just_after_the_deadline_is_not_a_second_reject(
    clock: FakeClock, make: Harness
) -> None:
    # gRPC cancels a call when the client's deadline passes, which is also the batcher's: the
    # cancel can land after the batcher's timer failed the request, before its task resumed.
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=4, batch_timeout_ms=0)
    busy = await occupy(batcher, runner)
    deadline = time.monotonic() + 60
    late = await spawn(batcher.submit(make_rows(1, start=100), deadline=deadline))
    # Due after the batcher's timer, run in the same turn of the loop: before ``late`` resumes.
    asyncio.get_running_loop().call_at(deadline + 1, late.cancel)
    clock.advance(61)
    assert isinstance(await settle(late), asyncio.CancelledError)
    assert make.rejects == ["deadline"]  # one request, one reject
    open_gate(runner)
    await busy
    assert [row_ids(b) for b in runner.batches] == [[0]]


async def test_rows_of_different_signatures_never_share_a_batch(make: Harness) -> None:
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms=20)
    wide = {"x": np.ones((2, 5), np.float32)}
    double = {"x": np.ones((1, 4), np.float64)}
    inputs = [make_rows(1), wide, make_rows(2, start=1), double]
    results = await asyncio.gather(*(batcher.submit(x) for x in inputs))
    shapes = sorted((b["x"].shape[1], b["x"].dtype.str, len(b["x"])) for b in runner.batches)
    assert shapes == [(4, "<f4", 4), (4, "<f8", 1), (5, "<f4", 2)]
    for result, x in zip(results, inputs, strict=True):
        assert_rows(result, x)


async def test_queues_are_served_oldest_head_first(make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms=0)
    busy = await occupy(batcher, runner)
    a1 = await spawn(batcher.submit(make_rows(1, start=1)))
    b1 = await spawn(batcher.submit(make_rows(1, start=2, width=5)))
    a2 = await spawn(batcher.submit(make_rows(1, start=3)))
    open_gate(runner)
    await asyncio.gather(busy, a1, b1, a2)
    assert [row_ids(b) for b in runner.batches] == [[0], [1, 3], [2]]


async def test_batches_are_padded_and_padding_is_dropped(make: Harness) -> None:
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms=0)
    x = make_rows(3)
    result = await batcher.submit(x)
    sent = runner.batches[0]["x"]
    assert sent.shape == (4, 4)
    np.testing.assert_array_equal(sent[3], x["x"][2])
    assert_rows(result, x)
    assert [(r.size, r.padded_size) for r in make.records] == [(3, 4)]


async def test_without_padding_the_runner_sees_each_batch_at_its_row_count(
    make: Harness,
) -> None:
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=32, batch_timeout_ms=0, pad_batches=False)
    x = make_rows(17)
    assert_rows(await batcher.submit(x), x)
    await batcher.submit(make_rows(3, start=17))
    assert runner.batch_sizes() == [17, 3]
    assert [(r.size, r.padded_size) for r in make.records] == [(17, 17), (3, 3)]


async def test_the_slo_cap_follows_the_stages_compute_reports(make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms="auto", slo_p99_ms=100)
    # The driver's wall times (queueing included) said 8 rows take a second...
    seed(batcher, {1: 0.001, 8: 1.0}, now=time.monotonic())
    # ...the stage actors report 8 rows computing in 20 + 30 ms.
    report = {"compute_by_rows": {1: {"ewma_ms": 1.0, "count": 9}, 8: {"ewma_ms": 20, "count": 2}}}
    stage1 = {"compute_by_rows": {1: {"ewma_ms": 1.0, "count": 9}, 8: {"ewma_ms": 30, "count": 2}}}
    batcher.observe_compute([{"stage_index": 0, **report}, {"stage_index": 1, **stage1}])
    busy = await occupy(batcher, runner)
    waiting = await spawn(batcher.submit(make_rows(6, start=1)))
    open_gate(runner)
    await asyncio.gather(busy, waiting)
    assert runner.batch_sizes() == [1, 8]  # 50 ms fits the 100 ms SLO: no cap


async def test_allowed_batch_sizes_choose_the_padding(make: Harness) -> None:
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=12, batch_timeout_ms=0, allowed_batch_sizes=(5,))
    await batcher.submit(make_rows(6))
    assert runner.batch_sizes() == [12]


async def test_a_failed_batch_reaches_every_caller_and_the_next_batch_works(
    make: Harness,
) -> None:
    runner = FakeRunner(fail_with=ValueError("boom"))
    batcher = await make(runner, max_batch_size=2, batch_timeout_ms=LONG_MS)
    outcomes = await asyncio.gather(
        *(settle(batcher.submit(make_rows(1, start=i))) for i in range(2))
    )
    for outcome in outcomes:
        assert isinstance(outcome, BatchFailedError)
        assert str(outcome) == "model failed on a batch of 2 rows: ValueError: boom"
    runner.fail_with = None
    x = make_rows(2, start=4)
    assert_rows(await batcher.submit(x), x)
    assert [r.ok for r in make.records] == [False, True]


async def test_a_shardserve_error_from_the_model_passes_through(make: Harness) -> None:
    runner = FakeRunner(fail_with=NotReadyError("stage 1 restarting"))
    batcher = await make(runner, batch_timeout_ms=0)
    with pytest.raises(NotReadyError, match="stage 1 restarting"):
        await batcher.submit(make_rows(1))


async def test_wrong_output_length_fails_the_batch(make: Harness) -> None:
    async def short(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": np.zeros((len(inputs["x"]) - 2, 2), np.float32)}

    batcher = await make(short, max_batch_size=4, batch_timeout_ms=0)
    with pytest.raises(BatchFailedError) as info:
        await batcher.submit(make_rows(3))
    assert str(info.value) == (
        "model returned 2 rows for output 'y' on a batch of 3 rows padded to 4; "
        "expected 4 (or the 3 real rows)"
    )


async def test_stop_drains_queued_rows_then_refuses(make: Harness) -> None:
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms=LONG_MS)
    inputs = [make_rows(1, start=i) for i in range(3)]
    tasks = [await spawn(batcher.submit(x)) for x in inputs]
    await batcher.stop(drain=True)
    for task, x in zip(tasks, inputs, strict=True):
        assert_rows(await task, x)
    assert [(r.size, r.reason) for r in make.records] == [(3, "flush")]
    with pytest.raises(NotReadyError, match="server is shutting down"):
        await batcher.submit(make_rows(1))


async def test_stop_without_drain_fails_queued_and_running_requests(make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=4, batch_timeout_ms=0)
    running = await occupy(batcher, runner)
    queued = await spawn(batcher.submit(make_rows(1, start=1)))
    await batcher.stop(drain=False)
    for task in (running, queued):
        outcome = await settle(task)
        assert isinstance(outcome, NotReadyError)
        assert "server is shutting down" in str(outcome)
    assert runner.calls_started == 1


async def test_reconfigure_applies_to_the_next_batch_and_keeps_queued_rows(
    make: Harness,
) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms=0)
    busy = await occupy(batcher, runner)
    queued = await spawn(batcher.submit(make_rows(6, start=1)))
    policy = batcher.reconfigure(max_batch_size=4)
    assert (policy.max_batch_size, batcher.settings.max_batch_size) == (4, 4)
    assert batcher.queued_rows == 6
    open_gate(runner)
    await busy
    assert_rows(await queued, make_rows(6, start=1))
    assert [row_ids(b) for b in runner.batches] == [[0], [1, 2, 3, 4], [5, 6]]


def test_reconfigure_rejects_bad_values_and_keeps_the_policy() -> None:
    batcher = Batcher(FakeRunner().run_batch, BatchSettings(max_batch_size=8))
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1, got 0"):
        batcher.reconfigure(max_batch_size=0)
    with pytest.raises(ValueError, match=r"unknown batching settings \['batch_size'\]"):
        batcher.reconfigure(batch_size=3)
    assert batcher.settings == BatchSettings(max_batch_size=8)


async def test_auto_policy_sends_at_once_when_idle(make: Harness) -> None:
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms="auto")
    x = make_rows(1)
    assert_rows(await batcher.submit(x), x)
    assert [(r.size, r.reason) for r in make.records] == [(1, "idle")]
    assert batcher.effective_wait_ms == 0.0


async def test_auto_policy_fills_batches_while_busy(make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms="auto")
    busy = await occupy(batcher, runner)
    waiting = [await spawn(batcher.submit(make_rows(2, start=1 + 2 * i))) for i in range(3)]
    assert runner.calls_started == 1
    open_gate(runner)
    await asyncio.gather(busy, *waiting)
    assert [(r.size, r.padded_size, r.reason) for r in make.records] == [
        (1, 1, "idle"),
        (6, 8, "idle"),
    ]


async def test_auto_policy_with_slo_caps_the_batch_size(make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms="auto", slo_p99_ms=100)
    # Seed the run-time model: one row is fast, a batch of 8 took a whole second just now.
    seed(batcher, {1: 0.001, 8: 1.0}, now=time.monotonic())
    assert batcher.effective_wait_ms == 0.0
    busy = await occupy(batcher, runner)
    waiting = await spawn(batcher.submit(make_rows(6, start=1)))
    open_gate(runner)
    await asyncio.gather(busy, waiting)
    assert runner.batch_sizes() == [1, 4, 2]


async def test_submit_before_start_is_not_ready() -> None:
    batcher = Batcher(FakeRunner().run_batch, BatchSettings())
    with pytest.raises(NotReadyError, match="not been started"):
        await batcher.submit(make_rows(1))


async def test_inputs_with_different_row_counts_are_invalid(make: Harness) -> None:
    batcher = await make(FakeRunner())
    with pytest.raises(InvalidInputError, match="same number of rows"):
        await batcher.submit({"x": np.ones((2, 4), np.float32), "z": np.ones((3,), np.float32)})


async def test_cancelled_drain_fails_what_is_left(make: Harness) -> None:
    # A server that bounds its drain (wait_for around stop) must still answer every request.
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=4, batch_timeout_ms=0)
    running = await occupy(batcher, runner)
    stopping = await spawn(batcher.stop(drain=True))
    stopping.cancel()
    assert isinstance(await settle(stopping), asyncio.CancelledError)
    outcome = await settle(running)
    assert isinstance(outcome, NotReadyError)
    assert "server is shutting down" in str(outcome)


async def test_auto_policy_sends_full_batches_once_the_slo_is_lost(make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms="auto", slo_p99_ms=100)
    seed(batcher, {1: 0.5})  # even one row misses the SLO: shrinking cannot help
    busy = await occupy(batcher, runner)
    waiting = await spawn(batcher.submit(make_rows(6, start=1)))
    open_gate(runner)
    await asyncio.gather(busy, waiting)
    assert runner.batch_sizes() == [1, 8]


async def test_auto_policy_spreads_the_outstanding_rows_over_the_stages(make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(
        runner, max_batch_size=8, batch_timeout_ms="auto", max_inflight_batches=3, pipeline_depth=2
    )
    seed(batcher, recent_s=30.0)  # a 30 s batch time: the wait cap never fires here
    first = await spawn(batcher.submit(make_rows(4)))  # idle pipeline: goes at once
    await runner.wait_started(1)
    queued = [await spawn(batcher.submit(make_rows(1, start=10 + i))) for i in range(3)]
    # 4 rows in flight + 3 queued over 2 stages (not the 3 slots): ceil(7 / 2) = 4 rows
    assert (runner.calls_started, batcher.queued_rows) == (1, 3)
    assert batcher.effective_wait_ms == 30_000.0
    last = await spawn(batcher.submit(make_rows(1, start=13)))
    await runner.wait_started(2)
    open_gate(runner)
    await asyncio.gather(first, *queued, last)
    assert [(r.size, r.reason) for r in make.records] == [(4, "idle"), (4, "target")]


async def test_auto_policy_never_spreads_over_more_batches_than_may_fly(make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(
        runner, max_batch_size=8, batch_timeout_ms="auto", max_inflight_batches=2, pipeline_depth=4
    )
    seed(batcher, recent_s=20.0)  # the wait cap never fires here
    first = await spawn(batcher.submit(make_rows(2)))
    await runner.wait_started(1)
    # 2 in flight + 2 queued over min(4 stages, 2 slots): ceil(4 / 2) = 2 rows, not 1
    queued = [await spawn(batcher.submit(make_rows(1, start=10 + i))) for i in range(2)]
    await runner.wait_started(2)
    open_gate(runner)
    await asyncio.gather(first, *queued)
    assert [(r.size, r.reason) for r in make.records] == [(2, "idle"), (2, "target")]


async def test_auto_policy_waits_at_most_one_batch_time(make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(runner, max_batch_size=8, batch_timeout_ms="auto", max_inflight_batches=2)
    seed(batcher, recent_s=0.002)  # batches take 2 ms
    first = await spawn(batcher.submit(make_rows(4)))
    await runner.wait_started(1)
    second = await spawn(batcher.submit(make_rows(1, start=10)))  # the target would be 3 rows
    await runner.wait_started(2)  # the batch time's timer sent it alone
    open_gate(runner)
    await asyncio.gather(first, second)
    assert [(r.size, r.reason) for r in make.records][:2] == [(4, "idle"), (1, "timeout")]


async def test_auto_policy_wait_is_shortened_to_keep_the_slo(make: Harness) -> None:
    runner = FakeRunner(gate=asyncio.Event())
    batcher = await make(
        runner, max_batch_size=8, batch_timeout_ms="auto", max_inflight_batches=2, slo_p99_ms=600
    )
    seed(batcher, {1: 0.2}, recent_s=2.0)  # a 2 s batch time
    assert batcher.effective_wait_ms == 0.0  # idle: a batch goes at once
    first = await occupy(batcher, runner)
    assert batcher.effective_wait_ms == pytest.approx(400.0)  # 600 ms SLO - 200 ms of compute
    open_gate(runner)
    await first


# --- the loop itself fails: a bug inside it (here in the wait policy it consults)


async def test_a_crashed_loop_is_logged_and_restarted(
    make: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    buggy_wait(monkeypatch, crashes=1)
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=2, batch_timeout_ms=LONG_MS)
    # One row is not a full batch: the loop asks the wait policy, which raises.
    with pytest.raises(BatchFailedError, match="the batcher failed"):
        await batcher.submit(make_rows(1))
    crashed = [r for r in caplog.records if r.getMessage().startswith("the batcher loop failed")]
    assert len(crashed) == 1 and crashed[0].exc_info is not None
    assert crashed[0].getMessage().endswith("; starting it again in 0 s")
    assert crashed[0].exc_info[0] is RuntimeError  # the traceback is in the log

    x = make_rows(2, start=1)
    assert_rows(await batcher.submit(x), x)  # the loop runs again
    assert batcher.failure is None


async def test_a_loop_that_keeps_crashing_leaves_the_batcher_failed(
    make: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    buggy_wait(monkeypatch, crashes=None)
    runner = FakeRunner()
    batcher = await make(runner, max_batch_size=2, batch_timeout_ms=LONG_MS)
    for i in range(LOOP_MAX_RESTARTS + 1):
        with pytest.raises(BatchFailedError):
            await batcher.submit(make_rows(1, start=i))
    assert batcher.failure == (
        f"the batcher crashed {LOOP_MAX_RESTARTS + 1} times in 60 s and was not restarted; "
        "restart the server (its log has the tracebacks)"
    )
    with pytest.raises(NotReadyError) as info:
        await batcher.submit(make_rows(2))
    assert str(info.value) == batcher.failure
    assert runner.batches == []
