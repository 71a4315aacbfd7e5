"""A request's times and trace as the batcher stamps them: the one record every answer's
``Server-Timing`` and access-log line, and the request's span, read.

The data plane makes one ``Stamp`` per request and sets it as ``CURRENT`` (a context
variable: the request's own task), where the batcher's ``submit`` picks it up onto the queued
request; the dispatcher then stamps it when its batch goes (the time it queued, why the batch
closed, the batch's rows) and when its batch is done (the compute). No OpenTelemetry here:
``span`` is whatever ``serving.telemetry.traces`` put there, and ``None`` with tracing off.

    queue    arrival in the batcher -> its first batch sent
    compute  its first batch sent -> its last batch done
    total    the data plane's start -> the answer sent
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any, Protocol

__all__ = ["CURRENT", "Segment", "Stamp", "Stamped", "batch_done", "batch_sent"]


class Stamp:
    """One request's times (``time.perf_counter`` for its start, ``time.monotonic`` for the
    batcher's) and what its batch was."""

    __slots__ = (
        "attempts",
        "batch_rows",
        "bytes_out",
        "done",
        "finish",
        "first_token_ms",
        "reason",
        "rows",
        "sent",
        "span",
        "started",
        "status",
        "tokens",
        "trace_id",
        "waited_s",
    )

    def __init__(self, started: float) -> None:
        self.started = started
        self.waited_s = 0.0  # in the batcher's queue, till its first batch was sent
        self.sent = 0.0  # when its first batch was sent (time.monotonic); 0: never
        self.done = 0.0  # when its last batch ended
        self.rows = 0
        self.batch_rows = 0
        self.attempts = 0  # batches its rows rode in (a retry, a held batch: one more)
        self.reason = ""  # why its (first) batch closed
        self.status = 0
        self.bytes_out = 0
        self.tokens = 0  # tokens it generated (a generation's: the access log's)
        self.first_token_ms = 0.0  # from its start to its first generated token; 0: none
        self.finish = ""  # how its generation ended (the access log's ``finish``)
        self.span: Any = None  # its request span, where tracing is on
        self.trace_id: str | None = None  # its trace id, where its span is sampled

    @property
    def queue_ms(self) -> float:
        return self.waited_s * 1000.0

    @property
    def compute_ms(self) -> float:
        return (self.done - self.sent) * 1000.0 if self.done > self.sent > 0.0 else 0.0

    def total_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0

    def server_timing(self) -> str:
        """The ``Server-Timing`` header's value (milliseconds), the total till now."""
        # queue_ms, compute_ms and total_ms without their calls: every answer writes it.
        done, sent = self.done, self.sent
        compute = (done - sent) * 1000.0 if done > sent > 0.0 else 0.0
        total = (time.perf_counter() - self.started) * 1000.0
        queue = self.waited_s * 1000.0
        return f"queue;dur={queue:.3f}, compute;dur={compute:.3f}, total;dur={total:.3f}"


CURRENT: ContextVar[Stamp | None] = ContextVar("shardserve_request_stamp", default=None)


class Stamped(Protocol):
    """A queued request as the stamps read it (``serving.batching.rows.PendingRequest``): the
    batcher imports this module, not the other way round."""

    @property
    def stamp(self) -> Stamp | None: ...

    @property
    def arrival(self) -> float: ...

    @property
    def request_id(self) -> str | None: ...


# A batch's part of one request: (the request, its first row in the batch, its rows).
Segment = tuple[Stamped, int, int]


def batch_sent(segments: Iterable[Segment], now: float, reason: str, rows: int) -> None:
    """Stamp the requests of a batch sent at ``now`` (``time.monotonic``), closed for
    ``reason`` with ``rows`` rows."""
    for request, _, _ in segments:
        stamp = request.stamp
        if stamp is None:
            continue
        if not stamp.sent:
            stamp.sent = now
            stamp.waited_s = now - request.arrival
            stamp.reason = reason
        stamp.batch_rows = rows
        stamp.attempts += 1


def batch_done(segments: Iterable[Segment], now: float) -> None:
    """Stamp the requests of a batch that ended at ``now``."""
    for request, _, _ in segments:
        stamp = request.stamp
        if stamp is not None:
            stamp.done = now


def batch_attributes(
    rows: int, padded: int, length: int, reason: str, segments: Iterable[Segment]
) -> dict[str, str | int | float | bool]:
    """What a batch span says of its batch (the replica set adds which replica ran it)."""
    attempt = max((r.stamp.attempts for r, _, _ in segments if r.stamp is not None), default=1)
    return {
        "shardserve.rows": rows,
        "shardserve.padded_rows": padded,
        "shardserve.length_bucket": length,
        "shardserve.close_reason": reason,
        "shardserve.attempt": attempt,
        "shardserve.requests": sum(1 for _ in segments),
    }
