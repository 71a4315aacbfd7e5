"""The dynamic batcher: rows from many requests become batches for one async ``run_batch``.

Rows, not requests, are the unit: a request of n rows takes n slots and may be split over batches.
Rows wait in one FIFO queue per input signature (per-row shapes and dtypes), so rows that cannot be
stacked never share a batch. A batch closes when it is full or when its oldest row has waited as
long as its wait policy allows (``serving.batching.wait``); up to ``max_inflight_batches`` batches
run at once so that pipeline stages overlap (``serving.batching.dispatch`` sends and runs them).
Every request is answered exactly once: with its rows' outputs, or with one error from
``serving.errors``. This module is the batcher's face (submit, reconfigure, stop) and its loop,
restarted after a crash by the supervisor every background task shares (``serving.supervisor``).
Pure asyncio and numpy: no Ray, no TensorFlow, no HTTP.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from serving.batching.admit import refusal
from serving.batching.batch_run import RunBatch
from serving.batching.cost import RunTimeModel
from serving.batching.dispatch import SHUTTING_DOWN, Dispatcher
from serving.batching.lengths import LengthPadding
from serving.batching.rows import PendingRequest, RowQueues, Segment, check_size, row_count
from serving.batching.settings import BatchSettings
from serving.batching.wait import WaitPolicy, wait_policy
from serving.errors import BatchFailedError, DeadlineExceededError, NotReadyError, ShardServeError
from serving.supervisor import start_supervised
from serving.telemetry.batch_record import BatchRecord

__all__ = ["BatchSettings", "Batcher", "RunBatch"]

log = logging.getLogger("shardserve")

# A loop that crashed is started again, but one that keeps crashing has a bug that restarts
# cannot fix: past this many restarts in the window the batcher stays down and readiness says so.
LOOP_MAX_RESTARTS = 3
LOOP_CRASH_WINDOW_S = 60.0


class Batcher:
    def __init__(
        self,
        run_batch: RunBatch,
        settings: BatchSettings,
        *,
        lengths: LengthPadding | None = None,
        on_batch: Callable[[BatchRecord], None] | None = None,
        on_reject: Callable[[str], None] | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        """``on_error(task)`` counts a crash of the loop (the server's background errors)."""
        self._settings = settings
        self._on_reject = on_reject
        self._on_error = on_error
        self._queues = RowQueues()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._accepting = False
        self._draining = False
        self._stopped = False
        self._failure: str | None = None
        self._runtime = RunTimeModel()
        self._wait: WaitPolicy = wait_policy(settings, self._runtime)
        self._dispatcher = Dispatcher(
            run_batch, self._queues, self._runtime, self._wake, self._fail_segments, on_batch
        )
        self._dispatcher.lengths = lengths

    @property
    def settings(self) -> BatchSettings:
        """The batch settings in force (``reconfigure`` swaps them)."""
        return self._settings

    @property
    def length_padding(self) -> LengthPadding | None:
        """The length padding in force (``serving.batching.lengths``); None: lengths queue apart."""
        return self._dispatcher.lengths

    def set_length_padding(self, lengths: LengthPadding | None) -> None:
        """Turn length padding on or off while nothing is queued (queued rows are keyed by it)."""
        if self._queues:
            raise RuntimeError("length padding changes only while no row is queued")
        self._dispatcher.lengths = lengths

    @property
    def queued_rows(self) -> int:
        return self._queues.rows

    @property
    def inflight_batches(self) -> int:
        return self._dispatcher.inflight

    @property
    def held_rows(self) -> int:  # lost batches' rows held for the replica (``hold``)
        return self._dispatcher.hold.rows

    def load(self) -> tuple[float, int]:  # for autoscaling: the oldest row's wait (s), rows out
        return self._queues.waited_s(time.monotonic()), self._dispatcher.inflight_rows

    @property
    def effective_wait_ms(self) -> float:
        """The longest a queue head now waits for rows, by the policy in force."""
        rows = max(1, self._queues.rows)
        return self._wait.wait_s(self._settings, rows, self._dispatcher.inflight) * 1000

    @property
    def failure(self) -> str | None:
        """Why the batcher stopped serving on its own (its loop kept crashing), in words for
        clients and ``/readyz``; None while it serves."""
        return self._failure

    def observe_compute(self, stage_stats: list[dict[str, Any]]) -> None:
        """The stage actors' compute per batch size (``runner.stats()``), for the policy."""
        self._runtime.observe_compute(stage_stats)

    def run_time_view(self) -> dict[str, Any]:
        """What the policy predicts per batch size (ms), for the admin route."""
        return self._runtime.view(self._settings.padded_sizes())

    async def start(self) -> None:
        if self._loop_task is not None:
            return
        self._accepting = True
        # A crash has failed what was queued (``_serve``); in-flight batches answer on their own,
        # so the loop starts again at once and loses nothing more.
        self._loop_task = start_supervised(
            "batcher", self._serve, what="the batcher loop", on_error=self._on_error,
            pause=(0.0, 0.0), give_up=(LOOP_MAX_RESTARTS, LOOP_CRASH_WINDOW_S),
            on_failure=self._down,
        )  # fmt: skip

    def reconfigure(self, **changes: Any) -> BatchSettings:
        """Swap in validated settings; it applies to the next batch, queued rows stay queued."""
        self._settings = self._settings.changed(**changes)
        self._wait = wait_policy(self._settings, self._runtime)
        self._wake.set()
        return self._settings

    async def submit(
        self,
        inputs: dict[str, np.ndarray],
        *,
        deadline: float | None = None,
        request_id: str | None = None,
    ) -> dict[str, np.ndarray]:
        """Queue the rows of ``inputs`` and return their outputs, rows in the same order.

        ``deadline`` is an absolute ``time.monotonic()`` value; ``request_id`` names the request
        in the log lines of its batch's failures. With length padding, outputs that follow the
        padded length come back cut to the request's own length.
        """
        return await self.submit_lengths(inputs, row_count(inputs), deadline, request_id, None)

    async def submit_lengths(
        self,
        inputs: dict[str, np.ndarray],
        rows: int,
        deadline: float | None,
        request_id: str | None,
        row_lengths: np.ndarray | None,
    ) -> dict[str, np.ndarray]:
        """``submit`` of ``rows`` rows whose own lengths (``row_lengths``, where they differ)
        are shorter than the length they were padded to (a ragged request's rows, padded
        above the batcher: ``serving.protocols.ragged``)."""
        if not self._accepting:
            if self._loop_task is None:
                raise NotReadyError("the batcher has not been started")
            if self._failure is not None:
                raise NotReadyError(self._failure)
            self._reject("shutdown")
            raise NotReadyError(SHUTTING_DOWN)
        settings, lengths = self._settings, self.length_padding
        check_size(inputs, rows, settings.max_queue_rows, lengths)
        refused = refusal(
            self._queues.rows, rows, deadline, settings, self._runtime, self._dispatcher.hold
        )
        if refused is not None:
            self._reject(refused[0])
            raise refused[1]
        loop = asyncio.get_running_loop()
        request = PendingRequest(
            inputs, rows, loop.create_future(), request_id,
            lengths=lengths, row_lengths=row_lengths, deadline=deadline,
        )  # fmt: skip
        self._queues.add(request)
        timer = None
        if deadline is not None:
            timer = loop.call_later(deadline - time.monotonic(), self._expire, request)
        self._wake.set()
        try:
            return await request.future  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            # The client went away: its rows still queued must not be computed. Counted only if
            # it found the request unanswered (not just failed by ``_expire``, which counted it).
            self._withdraw(request)
            if request.future.cancelled():
                self._reject("cancelled")
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def stop(self, *, drain: bool = True) -> None:
        """Stop accepting; with ``drain`` answer everything queued first, else fail it."""
        self._accepting = False
        self._stopped = True
        task = self._loop_task
        if task is None or task.done():
            self._abort()
            return
        if not drain:
            await self._abort_and_wait()
            return
        self._draining = True
        self._wake.set()
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            self._abort()
            raise
        if self._failure is not None:  # it kept crashing while draining: fail what is left
            await self._abort_and_wait()

    # --- the loop

    def _down(self, _: str) -> None:
        """The loop crashed more than ``LOOP_MAX_RESTARTS`` times within ``LOOP_CRASH_WINDOW_S``:
        a bug that restarts cannot fix, so the batcher stays down and readiness says why (in
        words for clients: the exception's text, in the supervisor's log line, may hold
        anything)."""
        self._failure = (
            f"the batcher crashed {LOOP_MAX_RESTARTS + 1} times in {LOOP_CRASH_WINDOW_S:g} s "
            "and was not restarted; restart the server (its log has the tracebacks)"
        )
        self._accepting = False
        self._fail_queued(NotReadyError(self._failure))  # submitted since the last crash

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._wake.clear()
                wake_at = self._dispatcher.dispatch_ready(
                    time.monotonic(), self._settings, self._wait, draining=self._draining
                )
                if self._draining and not self._queues and self._dispatcher.idle:
                    return
                timer = None
                if wake_at is not None:
                    timer = loop.call_later(max(0.0, wake_at - time.monotonic()), self._wake.set)
                try:
                    await self._wake.wait()
                finally:
                    if timer is not None:
                        timer.cancel()
        except Exception as exc:
            # The supervisor logs it with its traceback, counts it and starts the loop again
            # (what is submitted meanwhile queues for it); ``_down`` where it does not.
            # The exception's text is for that log line, not for clients: it may hold anything.
            self._fail_queued(
                BatchFailedError(
                    f"the batcher failed ({type(exc).__name__}); the server log has the detail"
                )
            )
            raise

    # --- answering requests

    def _fail_segments(self, segments: list[Segment], error: ShardServeError) -> None:
        for request, _, _ in segments:
            self._fail(request, error)

    def _fail(self, request: PendingRequest, error: ShardServeError) -> None:
        self._withdraw(request)
        if not request.future.done():
            request.future.set_exception(copy.copy(error))

    def _expire(self, request: PendingRequest) -> None:
        if request.future.done():
            return
        where = "in the queue" if request.next_row == 0 else "while its rows were being computed"
        self._reject("deadline")
        self._fail(request, DeadlineExceededError(f"the request's deadline passed {where}"))

    def _withdraw(self, request: PendingRequest) -> None:
        """Take the request's undispatched rows out of its queue so they are never computed."""
        if self._queues.remove(request):
            self._wake.set()  # the queue's head, and so the next timeout, may have changed

    def _fail_queued(self, error: ShardServeError) -> None:
        for request in self._dispatcher.waiting():
            self._fail(request, error)

    def _abort(self) -> None:
        """Fail what is queued, cancel the loop and the running batches (they fail their rows)."""
        self._accepting = False
        if self._loop_task is not None:
            self._loop_task.cancel()
        queued = self._dispatcher.waiting()
        self._fail_queued(NotReadyError(SHUTTING_DOWN))
        for _ in queued:
            self._reject("shutdown")
        for task in list(self._dispatcher.tasks):
            task.cancel()

    async def _abort_and_wait(self) -> None:
        pending = [*self._dispatcher.tasks, *([self._loop_task] if self._loop_task else [])]
        self._abort()
        # Cancelled batches fail their rows in their own ``finally``; let them get there.
        await asyncio.gather(*pending, return_exceptions=True)

    def _reject(self, reason: str) -> None:
        if self._on_reject is not None:
            try:
                self._on_reject(reason)
            except Exception:
                log.exception("on_reject callback failed")
