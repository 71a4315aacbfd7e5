"""Rows held while the model's replicas are brought back (``serving.errors.RecoveringError``).

A batch that comes back with a ``RecoveringError`` was never computed: no replica serves, and one
is being brought back (Ray restarting a dead stage actor, or a rebuild). Its rows wait here, ahead
of every queue and not counted against ``max_queue_rows``, and the dispatcher sends nothing until
the hold's ``back`` is done. The batch that was oldest on the replica when a stage died (its
``suspect``) may be what killed it: it runs again first and alone, and if it is lost again it
fails alone, so that the batches behind it are not held hostage by it. Requests keep queueing
meanwhile, each with its own deadline; one whose deadline falls before the replica is expected
back (the last recovery's time) gets a 503 with ``Retry-After`` at once, and so does every held
row where the recovery fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from serving.errors import BatchFailedError, NotReadyError, RecoveringError

if TYPE_CHECKING:
    from serving.batching.batch_run import FailSegments
    from serving.batching.rows import PendingRequest, Segment

log = logging.getLogger("shardserve")


class Hold:
    """The rows of lost batches, in the order they go again, and the recovery they wait for.
    ``wake`` is set when it ends; ``fail`` answers requests that cannot wait."""

    def __init__(self, wake: asyncio.Event, fail: FailSegments) -> None:
        self._wake = wake
        self._fail = fail
        self.back: asyncio.Future[str | None] | None = None
        self._expected = 0.0  # when the replica is expected back (time.monotonic())
        self._retry_after_s = 1.0
        self._began = 0.0
        # Batches on their last try (the suspect of a fault), run alone before anything else.
        self._last_tries: deque[list[Segment]] = deque()
        self._batches: deque[list[Segment]] = deque()  # lost behind it: next, in order

    @property
    def active(self) -> bool:
        """Waiting for a replica: nothing is sent meanwhile."""
        return self.back is not None and not self.back.done()

    @property
    def rows(self) -> int:
        """Held rows of requests still waiting for them (the gauge ``shardserve_held_rows``)."""
        return sum(n for r, _, n in self._segments() if not r.future.done())

    def requests(self) -> list[PendingRequest]:
        return list({id(r): r for r, _, _ in self._segments()}.values())

    def has_last_try(self) -> bool:
        return any(_live(batch) for batch in self._last_tries)

    def next_last_try(self) -> list[Segment] | None:
        while self._last_tries:
            live = _live(self._last_tries.popleft())
            if live:
                return live
        return None

    def next_batch(self) -> list[Segment] | None:
        while self._batches:
            live = _live(self._batches.popleft())
            if live:
                return live
        return None

    def lost(
        self,
        segments: list[Segment],
        error: RecoveringError,
        *,
        last_try: bool,
        queued: Iterable[PendingRequest],
    ) -> None:
        """A batch came back uncomputed with ``error``: hold its rows (or fail them, where this
        was the suspect's last try), and begin the hold if this is a new one."""
        live = _live(segments)
        if error.suspect and last_try:
            rows = sum(n for _, _, n in live)
            log.warning("a batch of %d rows was lost twice with its replica; failing it", rows)
            self._fail(
                live,
                BatchFailedError(
                    "the request's batch was lost twice with its replica (a stage process "
                    "died under it each time; it may be what kills it)"
                ),
            )
        elif error.suspect or last_try:
            self._last_tries.append(live)
        else:
            self._batches.append(live)
        self._begin(error, queued)

    def cannot_wait(self, deadline: float | None) -> NotReadyError | None:
        """The 503 for a request that would arrive during the hold with ``deadline``, where the
        replica is not expected back before it; None when it may queue."""
        if not self.active or deadline is None or deadline >= self._expected:
            return None
        return self._too_late()

    def _begin(self, error: RecoveringError, queued: Iterable[PendingRequest]) -> None:
        back = error.back
        if back is not None and back is not self.back:
            self.back = back
            now = time.monotonic()
            self._began = now
            self._retry_after_s = max(1.0, error.retry_after_s or 1.0)
            self._expected = now + self._retry_after_s
            if back.done():
                self._ended(back)
            else:
                back.add_done_callback(self._ended)
                log.warning(
                    "holding requests for the model's replica: expected back in %.3g s (the "
                    "last recovery's time); %d rows held, more queue meanwhile: %s",
                    self._retry_after_s,
                    self.rows,
                    error.message,
                )
        if self.active:
            late = [r for r in [*self.requests(), *queued] if _late(r, self._expected)]
            if late:
                self._fail([(r, r.next_row, r.queued) for r in late], self._too_late())
        self._wake.set()

    def _too_late(self) -> NotReadyError:
        left = max(1.0, self._expected - time.monotonic())
        return NotReadyError(
            f"the model is unavailable while its replica is brought back (expected in "
            f"{left:.3g} s, after this request's deadline); retry then",
            left,
        )

    def _ended(self, back: asyncio.Future[str | None]) -> None:
        if back is not self.back:
            return
        why = None if back.cancelled() else back.result()
        if why is not None:
            held = [*self._last_tries, *self._batches]
            self._last_tries.clear()
            self._batches.clear()
            log.warning("releasing the held requests with a 503: %s", why)
            error = NotReadyError(f"the model is unavailable: {why}", self._retry_after_s)
            for batch in held:
                self._fail(_live(batch), error)
        else:
            log.info(
                "the model's replica is back after %.3g s: %d held rows go first",
                time.monotonic() - self._began,
                self.rows,
            )
        self._wake.set()

    def _segments(self) -> list[Segment]:
        return [s for batch in [*self._last_tries, *self._batches] for s in batch]


def _live(segments: list[Segment]) -> list[Segment]:
    return [s for s in segments if not s[0].future.done()]


def _late(request: PendingRequest, expected: float) -> bool:
    deadline = request.deadline
    return not request.future.done() and deadline is not None and deadline < expected
