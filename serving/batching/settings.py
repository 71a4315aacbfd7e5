"""When a batch closes and how large it may be: the batching settings.

``BatchSettings`` is plain validated data; ``Batcher`` reads it afresh for every batch, so
settings swapped in with ``Batcher.reconfigure`` apply to the next batch. What a batch costs,
which the auto policy reads to honour ``slo_p99_ms``, is ``serving.batching.cost``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from serving.settings.config import padded_batch_sizes
from serving.settings.waits import AUTO, WaitMs, is_auto


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class BatchSettings:
    """How rows become batches.

    ``batch_timeout_ms``: the longest the oldest row of a batch waits for the batch to fill;
    0 dispatches at once; ``AUTO`` (``"auto"``, the default) is the auto policy
    (``serving.batching.wait.AutoWait``): an idle pipeline gets a batch at once; while batches
    are in flight, a free slot waits for its share of the outstanding rows over the
    ``pipeline_depth`` batches the pipeline computes at once, but never longer than one batch
    time (the recent average).
    ``slo_p99_ms`` is read only by the auto policy: it shortens that wait and caps a batch's
    size so that the oldest row's wait plus the predicted run time of the batch stays within it.
    ``pipeline_depth`` (stages x replicas) is read only by the auto policy too; it describes the
    model, not a choice, so the admin route does not change it; nor ``pipeline_stages``, the
    stages of one replica (``pipeline_depth / pipeline_stages`` replicas take batches).
    ``fill_while_busy``: a batch that may close (its wait ran out) while the first stage of every
    healthy replica is busy keeps taking rows until that stage is about to be free, the batch is
    full, or a member's deadline (or the SLO) needs it to go (``serving.batching.dispatch``); an
    idle pipeline still gets it at once. False: a batch closes on its wait alone.
    ``allowed_batch_sizes`` are the sizes batches are padded to
    (a compiled model traces once per size); empty means powers of two up to ``max_batch_size``.
    ``pad_batches`` False: a batch runs at its own row count and those sizes are only the caps
    the SLO rule picks from. The server pads on GPU stages (kernels are picked per shape) or
    when ``allowed_batch_sizes`` is set; CPU stages take any size with one trace, so padding
    there is only extra rows (measured in docs/tuning.md).
    """

    max_batch_size: int = 32
    batch_timeout_ms: WaitMs = AUTO
    max_inflight_batches: int = 1
    max_queue_rows: int = 128
    allowed_batch_sizes: tuple[int, ...] = ()
    slo_p99_ms: float | None = None
    pipeline_depth: int = 1
    pad_batches: bool = True
    pipeline_stages: int = 1
    fill_while_busy: bool = True

    def __post_init__(self) -> None:
        for name in (
            "max_batch_size",
            "max_inflight_batches",
            "max_queue_rows",
            "pipeline_depth",
            "pipeline_stages",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        timeout = self.batch_timeout_ms
        if timeout != AUTO and (not _is_number(timeout) or timeout < 0):
            raise ValueError(f"batch_timeout_ms must be a number >= 0 or 'auto', got {timeout!r}")
        slo = self.slo_p99_ms
        if slo is not None and (not _is_number(slo) or slo <= 0):
            raise ValueError(f"slo_p99_ms must be a number > 0 or None, got {slo!r}")
        if self.max_queue_rows < self.max_batch_size:
            raise ValueError(
                f"max_queue_rows must be >= max_batch_size ({self.max_batch_size}) so that a "
                f"batch can fill, got {self.max_queue_rows}"
            )
        sizes = self.allowed_batch_sizes
        for flag in ("pad_batches", "fill_while_busy"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if not isinstance(sizes, tuple) or not all(
            _is_int(s) and 1 <= s <= self.max_batch_size for s in sizes
        ):
            raise ValueError(
                f"allowed_batch_sizes must be a tuple of integers between 1 and max_batch_size "
                f"({self.max_batch_size}), got {sizes!r}"
            )

    def changed(self, **changes: Any) -> BatchSettings:
        """These settings with ``changes`` applied and validated (``ValueError`` otherwise)."""
        known = [f.name for f in dataclasses.fields(BatchSettings)]
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise ValueError(f"unknown batching settings {unknown}; expected some of {known}")
        if isinstance(changes.get("allowed_batch_sizes"), list):
            changes["allowed_batch_sizes"] = tuple(changes["allowed_batch_sizes"])
        return dataclasses.replace(self, **changes)

    @property
    def is_auto(self) -> bool:
        return is_auto(self.batch_timeout_ms)

    @property
    def entry_stages(self) -> int:
        """The first stages a batch may enter: one per healthy replica."""
        return max(1, self.pipeline_depth // self.pipeline_stages)

    def padded_sizes(self) -> tuple[int, ...]:
        """The sizes a batch may be padded to, sorted; ``max_batch_size`` is always one."""
        return padded_batch_sizes(self.max_batch_size, self.allowed_batch_sizes)

    def padded_size(self, n: int) -> int:
        """The smallest allowed batch size that holds ``n`` rows (``n`` without padding)."""
        if not 1 <= n <= self.max_batch_size:
            raise ValueError(f"a batch holds 1 to {self.max_batch_size} rows, got {n}")
        if not self.pad_batches:
            return n
        return next(s for s in self.padded_sizes() if s >= n)
