"""The batcher's rows: queued per input signature, taken into batches, and put back together per
request once computed (stacking a batch and cutting its outputs is ``serving.batching.poison``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import numpy as np

from serving.errors import InvalidInputError

QueueKey = tuple[tuple[str, tuple[int, ...], str], ...]


def queue_key(inputs: dict[str, np.ndarray]) -> QueueKey:
    """Rows with equal keys stack into one array per input; others must never share a batch."""
    return tuple(
        (name, tuple(inputs[name].shape[1:]), inputs[name].dtype.str) for name in sorted(inputs)
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


class PendingRequest:
    """One submit(): its rows, how many are handed to batches, and the outputs gathered so far."""

    __slots__ = (
        "arrival",
        "future",
        "inputs",
        "key",
        "next_row",
        "parts",
        "request_id",
        "rows",
        "rows_done",
    )

    def __init__(
        self,
        inputs: dict[str, np.ndarray],
        rows: int,
        future: asyncio.Future[Any],
        request_id: str | None = None,
    ):
        self.inputs = inputs
        self.request_id = request_id
        self.rows = rows
        self.key = queue_key(inputs)
        self.arrival = time.monotonic()
        self.future = future
        self.next_row = 0  # first row not yet handed to a batch
        self.rows_done = 0
        self.parts: list[tuple[int, dict[str, np.ndarray]]] = []

    @property
    def queued(self) -> int:
        return self.rows - self.next_row

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

    def requests(self) -> list[PendingRequest]:
        return [r for q in self._queues.values() for r in q]

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
