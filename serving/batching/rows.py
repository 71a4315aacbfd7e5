"""The batcher's rows: queued per input signature, taken into batches, stacked with padding, and
put back together per request once computed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from serving.errors import BatchFailedError, InvalidInputError

log = logging.getLogger("shardserve")

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


def assemble(segments: list[Segment], rows: int, padded: int) -> dict[str, np.ndarray]:
    """Stack the segments' rows per input, then repeat the last real row up to ``padded`` rows.

    Repeating a real row (not zeros) keeps the padding inside the model's normal input range.
    """
    batch: dict[str, np.ndarray] = {}
    for name in segments[0][0].inputs:
        parts = [r.inputs[name][start : start + n] for r, start, n in segments]
        if padded > rows:
            parts.append(np.repeat(parts[-1][-1:], padded - rows, axis=0))
        batch[name] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    return batch


def check_outputs(
    outputs: Any, rows: int, padded: int, request_ids: Sequence[str] = ()
) -> dict[str, np.ndarray]:
    """The outputs cut to the real rows; a model answer of any other shape fails the batch.

    What the model returned goes to the log with ``request_ids``; clients get its type only (its
    repr may hold anything: paths, addresses, object ids)."""
    if not isinstance(outputs, Mapping) or not outputs:
        log.error(
            "model returned %s for request(s) %s: %.200r",
            type(outputs).__name__,
            ",".join(request_ids) or "-",
            outputs,
        )
        raise BatchFailedError(
            f"model returned {'an empty ' if isinstance(outputs, Mapping) else 'a '}"
            f"{type(outputs).__name__}; expected a non-empty dict of output name -> array"
        )
    checked: dict[str, np.ndarray] = {}
    for name, value in outputs.items():
        array = np.asarray(value)
        got = array.shape[0] if array.ndim else "no"
        if got not in (rows, padded):
            expected = f"{padded}" if padded == rows else f"{padded} (or the {rows} real rows)"
            raise BatchFailedError(
                f"model returned {got} rows for output {name!r} on a batch of {rows} rows "
                f"padded to {padded}; expected {expected}"
            )
        checked[str(name)] = array[:rows]
    return checked


def deliver(segments: list[Segment], outputs: dict[str, np.ndarray]) -> None:
    """Hand each request its rows of a batch's outputs."""
    offset = 0
    for request, start, count in segments:
        request.add_outputs(start, {k: v[offset : offset + count] for k, v in outputs.items()})
        offset += count
