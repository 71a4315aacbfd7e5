"""Sending batches: which queue head may close now, how many of its rows go, and running each
batch with its accounting (the in-flight counts, the cost model, the batch's record).

The batcher owns the queues, the settings and the loop; each time its loop wakes it asks
``Dispatcher.dispatch_ready`` to send what may go and to say when to look again. While the
model's replicas are brought back nothing goes; then the rows held for them go first
(``serving.batching.hold``).

A batch whose wait ran out while the first stage of every healthy replica is busy would only
queue in front of that stage, half full, while the rows behind it start the next half-full
batch: with ``fill_while_busy`` it keeps taking rows until that stage is about to be free
(``pipeline_fit``, from the batches in flight, when each was sent and the first stage's compute
per batch size in ``serving.batching.cost``), the batch is full, or a member's deadline (or the
SLO) needs it to go. An idle pipeline gets a batch at once. A batch the auto wait closes on its
share of the outstanding rows ("target") goes as it is: held as well, at 16 clients and 2 stages
the batches travelled in step and the pipeline emptied between them (docs/tuning.md).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from serving.batching.batch_run import Outcome, batch_length, isolation_depth, settle
from serving.batching.hold import Hold
from serving.errors import NotReadyError, RecoveringError, ShardServeError
from serving.telemetry import active
from serving.telemetry.batch_record import BatchRecord
from serving.telemetry.stamp import batch_attributes, batch_done, batch_sent

if TYPE_CHECKING:
    from serving.batching.batch_run import FailSegments, RunBatch
    from serving.batching.cost import RunTimeModel
    from serving.batching.lengths import LengthPadding
    from serving.batching.rows import PendingRequest, QueueKey, RowQueues, Segment
    from serving.batching.settings import BatchSettings
    from serving.batching.wait import WaitPolicy

log = logging.getLogger("shardserve")

SHUTTING_DOWN = "server is shutting down"


def entry_free_at(sent: Iterable[tuple[float, float]], entries: int) -> float:
    """When the first of ``entries`` first stages (one per healthy replica) can take a batch,
    given the batches in flight as (when it was sent, its compute in the first stage): each
    stage takes them in the order they were sent, a batch going to the stage that frees first.
    -inf while one of them has nothing to do.

    Times are counted from when a batch is sent: the hop into the stage delays a batch in
    flight and the next one alike, so it cancels out (a batch sent at the time returned reaches
    the stage as it frees). The stage's own overhead beside its compute (taking the arguments,
    putting the outputs) is left out: a batch sent a little early waits a little in the stage's
    queue, a batch sent late would leave the stage idle."""
    free = [-math.inf] * max(1, entries)
    for at, compute_s in sorted(sent):
        first = free.index(min(free))
        free[first] = max(free[first], at) + compute_s
    return min(free)


def pipeline_fit(
    now: float, sent: Iterable[tuple[float, float]], entries: int, go_by: float
) -> tuple[float | None, str]:
    """Whether a batch that may close goes now: (None, why) to go now, or (until when it keeps
    taking rows, "filling"). It goes once a first stage is free (``entry_free_at``: at once
    into an idle pipeline), "stage_free", or once ``go_by`` is reached (the last moment its
    members' deadlines or the SLO allow), "deadline"."""
    free = entry_free_at(sent, entries)
    if free <= now:
        return None, "stage_free"
    if go_by <= now:
        return None, "deadline"
    return min(free, go_by), "filling"


class Dispatcher:
    """Takes rows from the batcher's queues into batches and runs them, up to
    ``max_inflight_batches`` at once; a finished batch sets ``wake`` so the loop looks again."""

    def __init__(
        self,
        run_batch: RunBatch,
        queues: RowQueues,
        runtime: RunTimeModel,
        wake: asyncio.Event,
        fail_segments: FailSegments,
        on_batch: Callable[[BatchRecord], None] | None,
    ) -> None:
        self._run_batch = run_batch
        self._queues = queues
        self._runtime = runtime
        self._wake = wake
        self._fail_segments = fail_segments
        self._on_batch = on_batch
        self.lengths: LengthPadding | None = None  # the batcher's length padding, if any
        self.inflight = 0
        self.inflight_rows = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.hold = Hold(wake, fail_segments)
        self._alone = False  # a batch on its last try runs: nothing else goes meanwhile
        # The batches in flight: when each was sent, its padded rows and length (the first
        # stage's compute for it is read from the cost model when it is needed).
        self._sent: dict[int, tuple[float, int, int]] = {}
        self._ids = itertools.count()
        self._filling: set[QueueKey] = set()  # heads kept taking rows while the stage is busy

    @property
    def idle(self) -> bool:
        """No batch in flight and no row held: a drain with nothing queued may end."""
        return self.inflight == 0 and not self.hold.rows

    def waiting(self) -> list[PendingRequest]:
        """Every request with rows not in a batch: held (``serving.batching.hold``) or queued."""
        held = self.hold.requests()
        return [*held, *(r for r in self._queues.requests() if r not in held)]

    def dispatch_ready(
        self, now: float, policy: BatchSettings, wait: WaitPolicy, *, draining: bool
    ) -> float | None:
        """Send every batch that may go now; return when the next timeout falls due, if any."""
        if self.hold.active or self._alone:
            return None  # the replica's return, or the last try's end, wakes the loop
        if self.hold.has_last_try():
            batch = self.hold.next_last_try() if self.inflight == 0 else None
            if batch is not None:
                self._start(batch, "retry", now, policy, last_try=True)
            return None
        while self.inflight < policy.max_inflight_batches:
            batch = self.hold.next_batch()
            if batch is None:
                break
            self._start(batch, "held", now, policy)
        filling: dict[QueueKey, float] = {}  # heads that may close, kept filling: until when
        while self.inflight < policy.max_inflight_batches:
            ready: tuple[float, QueueKey, str, int] | None = None
            filling = {}
            for key, oldest, rows in self._queues.heads():
                length = self._head_length(key, policy)
                reason = self._close_reason(oldest, rows, now, policy, wait, draining, length)
                if reason is None:
                    continue
                if reason == "timeout":  # its wait ran out: not full, nor the auto wait's share
                    until, why = self._fit(key, oldest, rows, now, policy, length)
                    if until is not None:
                        filling[key] = until
                        continue
                    if why and (why == "deadline" or key in self._filling):
                        reason = why  # the stage is busy, or it was kept filling: why it goes
                if ready is None or oldest < ready[0]:
                    ready = (oldest, key, reason, rows)  # oldest head first: served fairly
            if ready is None:
                break
            self._filling.discard(ready[1])
            self._dispatch(ready[1], ready[0], ready[2], now, policy, wait, queued=ready[3])
        if self.inflight >= policy.max_inflight_batches:
            return None  # a finishing batch, a submit or a reconfigure wakes the loop
        self._filling = set(filling)
        return min(
            (
                filling[key]
                if key in filling
                else old + wait.wait_s(policy, n, self.inflight, self._head_length(key, policy))
                for key, old, n in self._queues.heads()
            ),
            default=None,
        )

    def _fit(
        self,
        key: QueueKey,
        oldest: float,
        rows: int,
        now: float,
        policy: BatchSettings,
        length: int,
    ) -> tuple[float | None, str]:
        """``pipeline_fit`` for the head of ``key``, from what this dispatcher has in flight
        (nothing in flight: the stage is free); (None, "") where the rule is off or the first
        stage has not reported its compute."""
        if not policy.fill_while_busy:
            return None, ""
        if not self._sent:
            return None, "stage_free"  # the pipeline emptied: its first stage is free
        sent = []
        for at, padded, padded_length in self._sent.values():
            compute_s = self._runtime.entry_s(padded, padded_length)
            if compute_s is None:
                return None, ""
            sent.append((at, compute_s))
        size = min(rows, policy.max_batch_size)
        run_s = self._runtime.predict(policy.padded_size(size), length) or 0.0
        go_by = math.inf
        deadline = self._queues.earliest_deadline(key, size)
        if deadline is not None:
            go_by = deadline - run_s
        if policy.slo_p99_ms is not None:
            go_by = min(go_by, oldest + policy.slo_p99_ms / 1000 - run_s)
        return pipeline_fit(now, sent, policy.entry_stages, go_by)

    def _head_length(self, key: QueueKey, policy: BatchSettings) -> int:
        """The bucket a batch from this queue would be length padded to, at most (0 without
        length padding): what the cost model prices it at, which only an SLO asks for."""
        lengths = self.lengths
        if lengths is None or policy.slo_p99_ms is None:
            return 0
        return lengths.bucket(self._queues.longest(key))

    def _close_reason(
        self,
        oldest: float,
        rows: int,
        now: float,
        policy: BatchSettings,
        wait: WaitPolicy,
        draining: bool,
        length: int = 0,
    ) -> str | None:
        if rows >= policy.max_batch_size:
            return "full"
        if draining:
            return "flush"
        return wait.close_reason(
            policy,
            rows=rows,
            waited_s=now - oldest,
            inflight_batches=self.inflight,
            outstanding_rows=self.inflight_rows + self._queues.rows,
            length=length,
        )

    def _dispatch(
        self,
        key: QueueKey,
        oldest: float,
        reason: str,
        now: float,
        policy: BatchSettings,
        wait: WaitPolicy,
        *,
        queued: int,
    ) -> None:
        length = self._head_length(key, policy)
        limit = wait.batch_limit(policy, now - oldest, now, queued, length)
        self._start(self._queues.take(key, limit), reason, now, policy, oldest=oldest)

    def _start(
        self,
        segments: list[Segment],
        reason: str,
        now: float,
        policy: BatchSettings,
        *,
        oldest: float | None = None,
        last_try: bool = False,
    ) -> None:
        rows = sum(count for _, _, count in segments)
        if oldest is None:
            oldest = min(request.arrival for request, _, _ in segments)
        alone = self.inflight == 0
        self.inflight += 1
        self.inflight_rows += rows
        if last_try:
            self._alone = True
        batch_id = next(self._ids)
        self._sent[batch_id] = (now, policy.padded_size(rows), batch_length(segments, self.lengths))
        # Not supervised: a batch is no loop to restart, and ``_run``'s one try/except delivers
        # its every outcome (answers, a failure, a cancel) to its requests' futures.
        run = self._run(
            segments, rows, reason, now - oldest, policy,
            alone=alone, last_try=last_try, batch_id=batch_id,
        )  # fmt: skip
        task = asyncio.create_task(run)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _lost(self, segments: list[Segment], error: ShardServeError, *, last_try: bool) -> None:
        """Fail the segments with ``error``, or hold them where the replica is being brought
        back (``serving.batching.hold``)."""
        if isinstance(error, RecoveringError) and error.back is not None:
            self.hold.lost(segments, error, last_try=last_try, queued=self._queues.requests())
        else:
            self._fail_segments(segments, error)

    async def _run(
        self,
        segments: list[Segment],
        rows: int,
        reason: str,
        queue_wait_s: float,
        policy: BatchSettings,
        *,
        alone: bool = False,
        last_try: bool = False,
        batch_id: int = -1,
    ) -> None:
        padded = policy.padded_size(rows)
        lengths = self.lengths
        length = batch_length(segments, lengths)
        positions = sum(request.positions(start, n) for request, start, n in segments)
        started = time.monotonic()
        outcome = Outcome()
        batch_sent(segments, started, reason, rows)
        tracer = active.tracer
        span = None
        if tracer is not None:
            span = tracer.batch(segments, batch_attributes(rows, padded, length, reason, segments))
        try:
            await settle(
                self._run_batch, segments, policy, isolation_depth(segments), outcome,
                lambda lost, error: self._lost(lost, error, last_try=last_try), lengths,
            )  # fmt: skip
        except BaseException:
            self._fail_segments(
                segments, NotReadyError(f"{SHUTTING_DOWN}: the batch was cancelled")
            )
            raise
        finally:
            run_s = time.monotonic() - started
            batch_done(segments, started + run_s)
            if span is not None and tracer is not None:
                tracer.batch_end(span, outcome.clean, outcome.isolated)
            # Decrement before waking the loop so that it sees the free slot.
            self.inflight -= 1
            self.inflight_rows -= rows
            self._sent.pop(batch_id, None)
            if last_try:
                self._alone = False
            if outcome.clean:
                self._runtime.observe(
                    padded, run_s, now=started + run_s, alone=alone, length=length
                )
            self._wake.set()
            record = BatchRecord(
                rows, padded, reason, queue_wait_s, run_s, outcome.clean, outcome.isolated,
                positions=positions, padded_positions=rows * length - positions,
            )  # fmt: skip
            if self._on_batch is not None:
                try:
                    self._on_batch(record)
                except Exception:
                    log.exception("on_batch callback failed")
