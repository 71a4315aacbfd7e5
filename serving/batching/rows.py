"""The batcher's rows: queued per input signature, taken into batches, and put back together per
request once computed (stacking a batch and cutting its outputs is ``serving.batching.batch_run``).

With length padding (``serving.batching.lengths``) the signature leaves the padded axis out, so
rows of every length share one queue; each request keeps its own length to be cut back to.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from serving.errors import InvalidInputError
from serving.telemetry.stamp import CURRENT

if TYPE_CHECKING:
    from serving.batching.lengths import LengthPadding

QueueKey = tuple[tuple[str, tuple[int, ...], str], ...]


def queue_key(inputs: dict[str, np.ndarray], lengths: LengthPadding | None = None) -> QueueKey:
    """Rows with equal keys stack into one array per input (after length padding, when there is
    some); others must never share a batch."""
    if lengths is None:
        return tuple(
            (name, tuple(inputs[name].shape[1:]), inputs[name].dtype.str) for name in sorted(inputs)
        )
    return tuple(
        (name, lengths.key_shape(name, tuple(inputs[name].shape[1:])), inputs[name].dtype.str)
        for name in sorted(inputs)
    )


def row_count(inputs: dict[str, np.ndarray]) -> int:
    """The common first dimension of every input; it must be at least 1."""
    if not inputs:
        raise InvalidInputError("a request needs at least one input array, got none")
    counts: dict[str, int | None] = {}
    for name, value in inputs.items():
        if not isinstance(value, np.ndarray):
            raise InvalidInputError(
                f"input {name!r} is a {type(value).__name__}; expected a numpy array"
            )
        counts[name] = value.shape[0] if value.ndim else None
    distinct = set(counts.values())
    rows = distinct.pop() if len(distinct) == 1 else None
    if rows is None or rows < 1:
        raise InvalidInputError(
            f"every input needs the same number of rows (>= 1) in its first dimension, got {counts}"
        )
    return rows


def check_size(
    inputs: dict[str, np.ndarray], rows: int, max_queue_rows: int, lengths: LengthPadding | None
) -> None:
    """A request that could never be queued, however empty the queue: a 400, not a 503."""
    if rows > max_queue_rows:
        raise InvalidInputError(
            f"request has {rows} rows; at most {max_queue_rows} (max_queue_rows) fit"
        )
    if lengths is not None and lengths.length_of(inputs) > lengths.max_length:
        raise InvalidInputError(
            f"request has length {lengths.length_of(inputs)}; at most {lengths.max_length} "
            "(max_sequence_length) is served"
        )


class PendingRequest:
    """One submit(): its rows, how many are handed to batches, and the outputs gathered so far."""

    __slots__ = (
        "arrival",
        "deadline",
        "future",
        "inputs",
        "key",
        "length",
        "next_row",
        "parts",
        "request_id",
        "row_lengths",
        "rows",
        "rows_done",
        "stamp",
    )

    def __init__(
        self,
        inputs: dict[str, np.ndarray],
        rows: int,
        future: asyncio.Future[Any],
        request_id: str | None = None,
        *,
        lengths: LengthPadding | None = None,
        row_lengths: np.ndarray | None = None,
        deadline: float | None = None,
    ):
        self.inputs = inputs
        self.deadline = deadline  # time.monotonic(); held rows are refused early past it
        self.request_id = request_id
        self.rows = rows
        self.key = queue_key(inputs, lengths)
        # Its length along the padded axes (0 without length padding): what a batch is padded
        # from and its outputs are cut back to. ``row_lengths``: each row's own, where a ragged
        # request's rows were padded to the longest of them before it was queued.
        self.length = lengths.length_of(inputs) if lengths is not None else 0
        self.row_lengths = row_lengths
        self.arrival = time.monotonic()
        self.future = future
        self.next_row = 0  # first row not yet handed to a batch
        self.rows_done = 0
        self.parts: list[tuple[int, dict[str, np.ndarray]]] = []
        # The data plane's record of the request (``serving.telemetry.stamp``), where it has one.
        self.stamp = CURRENT.get()
        if self.stamp is not None:
            self.stamp.rows = rows

    @property
    def queued(self) -> int:
        return self.rows - self.next_row

    def positions(self, start: int, count: int) -> int:
        """The real positions of rows ``start...start+count`` (their lengths summed)."""
        if self.row_lengths is not None:
            return int(self.row_lengths[start : start + count].sum())
        return self.length * count

    def add_outputs(self, start: int, outputs: dict[str, np.ndarray]) -> None:
        """Keep the outputs of rows ``start...``; answer the request once all rows are in."""
        if self.future.done():
            return
        self.parts.append((start, outputs))
        self.rows_done += len(next(iter(outputs.values())))
        if self.rows_done < self.rows:
            return
        if len(self.parts) == 1:
            self.future.set_result(outputs)
            return
        ordered = [part for _, part in sorted(self.parts, key=lambda p: p[0])]
        joined = {k: np.concatenate([p[k] for p in ordered], axis=0) for k in ordered[0]}
        self.future.set_result(joined)


# (request, its first row in the batch, row count), in batch order
Segment = tuple[PendingRequest, int, int]


class RowQueues:
    """One FIFO of requests per queue key; counts the rows not yet handed to a batch."""

    def __init__(self) -> None:
        self._queues: dict[QueueKey, deque[PendingRequest]] = {}
        self._rows: dict[QueueKey, int] = {}
        self.rows = 0

    def __bool__(self) -> bool:
        return bool(self._queues)

    def add(self, request: PendingRequest) -> None:
        self._queues.setdefault(request.key, deque()).append(request)
        self._rows[request.key] = self._rows.get(request.key, 0) + request.queued
        self.rows += request.queued

    def heads(self) -> list[tuple[QueueKey, float, int]]:
        """(key, arrival of the oldest queued row, queued rows) of every non-empty queue."""
        return [(key, q[0].arrival, self._rows[key]) for key, q in self._queues.items()]

    def waited_s(self, now: float) -> float:
        """How long the oldest queued row has waited at ``now`` (0 with none queued)."""
        return max((now - q[0].arrival for q in self._queues.values() if q), default=0.0)

    def longest(self, key: QueueKey) -> int:
        """The longest request queued under ``key`` (0 without length padding): the length its
        next batch is padded from, at most."""
        queue = self._queues.get(key)
        return max((r.length for r in queue), default=0) if queue else 0

    def requests(self) -> list[PendingRequest]:
        return [r for q in self._queues.values() for r in q]

    def earliest_deadline(self, key: QueueKey, rows: int) -> float | None:
        """The earliest deadline among the requests whose rows the next ``rows``-row batch of
        ``key`` would take; None where none of them has one."""
        earliest: float | None = None
        taken = 0
        for request in self._queues.get(key, ()):
            if taken >= rows:
                break
            taken += request.queued
            if request.deadline is not None and (earliest is None or request.deadline < earliest):
                earliest = request.deadline
        return earliest

    def remove(self, request: PendingRequest) -> bool:
        """Drop the request's rows not yet in a batch; True when some were dropped."""
        queue = self._queues.get(request.key)
        dropped = request.queued if queue is not None and request in queue else 0
        if dropped:
            queue.remove(request)  # type: ignore[union-attr]
            self._count(request.key, -dropped)
        request.next_row = request.rows
        return dropped > 0

    def take(self, key: QueueKey, limit: int) -> list[Segment]:
        """Up to ``limit`` rows from the head of one queue; a request may straddle two batches."""
        queue = self._queues[key]
        segments: list[Segment] = []
        taken = 0
        while queue and taken < limit:
            request = queue[0]
            count = min(request.queued, limit - taken)
            segments.append((request, request.next_row, count))
            request.next_row += count
            taken += count
            if request.queued == 0:
                queue.popleft()
        self._count(key, -taken)
        return segments

    def _count(self, key: QueueKey, delta: int) -> None:
        self.rows += delta
        self._rows[key] += delta
        if not self._queues[key]:
            del self._queues[key], self._rows[key]
