"""What a stage's batches cost: compute time per row count and per (rows, length) shape, the
figures the server's cost model predicts batch times from
(``serving.batching.cost.RunTimeModel``), and one log line the first time a stage runs a shape.

A batch's length is the size of the first dimension left unknown among the stage's inputs (a
sequence length); 0 when every dimension is known. With length padding the server sends one
length per bucket, so the distinct shapes stay few; many of them mean requests of many lengths
reach the model unpadded, each shape costing its own kernels and caches.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from shards.signature import TensorSpec

COMPUTE_EWMA_ALPHA = 0.2

log = logging.getLogger(__name__)


def _first_unknown(specs: Sequence[TensorSpec]) -> tuple[int, int] | None:
    """(input position, axis counting the batch) of the first unknown dimension; None if none."""
    for position, spec in enumerate(specs):
        for axis, dim in enumerate(spec.shape, start=1):
            if dim is None:
                return position, axis
    return None


def _observe(entries: dict[Any, list[float]], key: Any, ms: float) -> bool:
    """Fold ``ms`` into the EWMA under ``key``; True when ``key`` is new."""
    entry = entries.get(key)
    if entry is None:
        entries[key] = [ms, 1]
        return True
    entry[0] += COMPUTE_EWMA_ALPHA * (ms - entry[0])
    entry[1] += 1
    return False


def _report(ms: float, count: float) -> dict[str, Any]:
    return {"ewma_ms": ms, "count": int(count)}


class ComputeLog:
    def __init__(self, stage_index: int, inputs: Sequence[TensorSpec]) -> None:
        self._stage = stage_index
        self._length_at = _first_unknown(inputs)
        self._by_rows: dict[int, list[float]] = {}
        self._by_shape: dict[tuple[int, int], list[float]] = {}

    def length_of(self, tensors: Sequence[Any]) -> int:
        if self._length_at is None or len(tensors) <= self._length_at[0]:
            return 0
        position, axis = self._length_at
        return int(np.shape(tensors[position])[axis])

    def record(self, tensors: Sequence[Any], elapsed_s: float) -> None:
        """One batch the stage ran on ``tensors`` (its inputs, batch dimension first)."""
        rows = int(np.shape(tensors[0])[0]) if tensors else 1
        length = self.length_of(tensors)
        ms = elapsed_s * 1000.0
        _observe(self._by_rows, rows, ms)
        if _observe(self._by_shape, (rows, length), ms):
            log.info(
                "stage %d ran a new shape: %s (%d distinct so far)",
                self._stage,
                f"{rows} rows x {length} positions" if self._length_at else f"{rows} rows",
                len(self._by_shape),
            )

    def stats(self) -> dict[str, Any]:
        """``compute_by_rows`` ({rows: {"ewma_ms", "count"}}), ``compute_by_shape`` (the same
        under "ROWS,LENGTH") and ``shapes_run`` (how many distinct shapes): compute only, no
        queueing or transfer."""
        return {
            "compute_by_rows": {rows: _report(*entry) for rows, entry in self._by_rows.items()},
            "compute_by_shape": {
                f"{rows},{length}": _report(*entry)
                for (rows, length), entry in self._by_shape.items()
            },
            "shapes_run": len(self._by_shape),
        }
