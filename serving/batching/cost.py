"""What a batch of each size costs, from the stage actors' compute times: the cost model the auto
wait policy (``serving.batching.wait.AutoWait``) reads to honour ``slo_p99_ms``, and the batcher
reads for its ``Retry-After`` hint.

A batch's shape is (padded rows, length): the length is the bucket a length-padded batch was
padded to (``serving.batching.lengths``), 0 for a model without one. A 16-row batch of 128
tokens costs several times one of 16 tokens, so estimates are kept per shape.
"""

from __future__ import annotations

import math
from typing import Any

_EWMA_ALPHA = 0.2
# A batch size that has not run for this long may run once to be measured again.
STALE_S = 10.0

Shape = tuple[int, int]  # (padded rows, length bucket; 0 when the model has no length)


class RunTimeModel:
    """What a batch of each padded size costs, from the stage actors' own compute times.

    The actors time each batch's compute (``ShardActor.stats()["compute_by_rows"]``, fed in by
    the server's stats poll through ``observe_compute``); the driver's wall time of a batch also
    holds the time it queued inside the pipeline, so under load it tracks the load, not the
    batch. Latency (the SLO rule): the sum of the stages' compute plus the hop overhead (Ray
    calls, transfers), measured as wall minus compute on batches sent into an idle pipeline.
    Throughput (``bottleneck_s``): the slowest stage, which sets the pace of a full pipeline.
    Before the first report the driver's wall times stand in. ``largest_within`` lets a size
    that has not run for ``stale_s`` run once, so that a size predicted too slow is measured
    again instead of being ruled out for good. Every estimate is per (rows, length) shape;
    ``length`` defaults to 0, the shape of a model without a length.
    """

    def __init__(self, stale_s: float = STALE_S) -> None:
        self.stale_s = stale_s
        self._wall: dict[Shape, float] = {}  # EWMA of the driver's wall time per shape
        self._latency: dict[Shape, float] = {}  # per shape: the stages' compute summed
        self._bottleneck: dict[Shape, float] = {}  # per shape: the slowest stage's compute
        self._entry: dict[Shape, float] = {}  # per shape: the first stage's compute
        self._idle_over_s: float | None = None  # EWMA of wall - compute, idle pipeline
        self._least_over_s: float | None = None  # the least wall - compute seen, any load
        self._last_run: dict[Shape, float] = {}  # when a batch of the shape last ran or probed
        self.recent_s: float | None = None  # EWMA over batches of any size (wall)

    def observe(
        self,
        padded_size: int,
        run_s: float,
        *,
        now: float | None = None,
        alone: bool = False,
        length: int = 0,
    ) -> None:
        """A batch's wall time in the driver; ``alone``: sent while no other batch ran."""
        shape = (padded_size, length)
        old = self._wall.get(shape)
        self._wall[shape] = run_s if old is None else old + _EWMA_ALPHA * (run_s - old)
        recent = self.recent_s
        self.recent_s = run_s if recent is None else recent + _EWMA_ALPHA * (run_s - recent)
        if now is not None:
            self._last_run[shape] = now
        compute = self._latency.get(shape)
        if compute is None:
            return
        over = max(0.0, run_s - compute)
        least = self._least_over_s
        self._least_over_s = over if least is None else min(least, over)
        if alone:
            idle = self._idle_over_s
            self._idle_over_s = over if idle is None else idle + _EWMA_ALPHA * (over - idle)

    def observe_compute(self, stage_stats: list[dict[str, Any]]) -> None:
        """Replace the compute estimates with the actors' reports: one dict per stage actor
        with ``stage_index`` and ``compute_by_shape`` ({"ROWS,LENGTH": {"ewma_ms", "count"}}),
        or, from an actor that keeps no shapes, ``compute_by_rows`` ({rows: ...}, length 0);
        replicas of a stage are averaged. A shape enters once every stage has run it."""
        per_stage: dict[int, dict[Shape, list[float]]] = {}
        for report in stage_stats:
            by_shape = _by_shape(report)
            if by_shape is None:
                continue
            stage = per_stage.setdefault(int(report.get("stage_index", 0)), {})
            for shape, entry in by_shape.items():
                if isinstance(entry, dict) and entry.get("count"):
                    stage.setdefault(shape, []).append(float(entry["ewma_ms"]) / 1000)
        if not per_stage:
            return
        stages = [{n: sum(v) / len(v) for n, v in s.items()} for s in per_stage.values()]
        common = set.intersection(*(set(s) for s in stages))
        self._latency = {n: sum(s[n] for s in stages) for n in common}
        self._bottleneck = {n: max(s[n] for s in stages) for n in common}
        first = per_stage.get(0, {})
        self._entry = {n: sum(v) / len(v) for n, v in first.items()}

    @property
    def hop_s(self) -> float:
        """A batch's time outside the stages' compute: from idle batches, else the least seen."""
        if self._idle_over_s is not None:
            return self._idle_over_s
        return self._least_over_s or 0.0

    def predict(self, padded_size: int, length: int = 0) -> float | None:
        """Seconds from sending a batch of ``padded_size`` rows (of ``length``) to its answer
        with nothing queued ahead of it; ``None`` before any batch."""
        if self._latency:
            return _scaled(self._latency, (padded_size, length)) + self.hop_s
        return _scaled(self._wall, (padded_size, length)) if self._wall else None

    def bottleneck_s(self, padded_size: int, length: int = 0) -> float | None:
        """Seconds between batches of ``padded_size`` rows (of ``length``) leaving a busy
        pipeline."""
        if self._bottleneck:
            return _scaled(self._bottleneck, (padded_size, length))
        return self.predict(padded_size, length)

    def entry_s(self, padded_size: int, length: int = 0) -> float | None:
        """Seconds the first stage computes a batch of ``padded_size`` rows (of ``length``),
        from its own reports only; None before its first (the driver's wall time holds the
        pipeline's queueing under load, no measure of one stage)."""
        if not self._entry:
            return None
        return _scaled(self._entry, (padded_size, length))

    def retry_after_s(self, rows: int, max_batch_size: int) -> float:
        """Whole seconds until ``rows`` queued rows are likely through: a busy pipeline answers
        one batch per bottleneck stage's compute time (replicas shorten that: a hint that errs
        long)."""
        per_batch_s = self.bottleneck_s(max_batch_size) or 0.1
        return float(max(1, math.ceil(math.ceil(rows / max_batch_size) * per_batch_s)))

    def lengths(self) -> list[int]:
        """The lengths measured so far, sorted (``[0]`` for a model without one)."""
        return sorted({length for _, length in (self._latency or self._wall)})

    def view(self, sizes: tuple[int, ...]) -> dict[str, Any]:
        """Milliseconds per size: predicted latency and bottleneck; the hop; from compute?
        For a length-padded model, ``by_length`` holds the same per length bucket measured."""

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000, 3)

        def per_size(length: int) -> dict[str, Any]:
            return {
                "latency": {str(size): ms(self.predict(size, length)) for size in sizes},
                "bottleneck": {str(size): ms(self.bottleneck_s(size, length)) for size in sizes},
            }

        measured = self.lengths()
        longest = measured[-1] if measured else 0
        return {
            "from_compute": bool(self._latency),
            "hop": ms(self.hop_s),
            **per_size(longest),
            "by_length": {str(length): per_size(length) for length in measured if length},
        }

    def is_stale(self, size: int, now: float, length: int = 0) -> bool:
        """The measurement ``predict(size, length)`` rests on (its own, or the nearest
        shape's) is from a batch older than ``stale_s``, and no batch of that shape ran since."""
        measured = self._latency or self._wall
        if not measured:
            return False
        shape = (size, length)
        source = _nearest(measured, shape)
        last = max(self._last_run.get(source, -math.inf), self._last_run.get(shape, -math.inf))
        return now - last >= self.stale_s

    def largest_within(
        self,
        budget_s: float,
        sizes: tuple[int, ...],
        now: float | None = None,
        queued: int | None = None,
        length: int = 0,
    ) -> int | None:
        """The largest of ``sizes`` predicted to finish within ``budget_s``; None if none is.

        With nothing measured every size fits, so the auto policy batches as it would without
        an SLO. Given ``now`` and more ``queued`` rows than that size, the smallest larger size
        whose estimate is stale is returned instead, once per ``stale_s``: one batch measures
        it again.
        """
        best = None
        for size in sizes:
            predicted = self.predict(size, length)
            if predicted is None or predicted <= budget_s:
                best = size
        if now is None or queued is None or best is None or queued <= best:
            return best
        for size in sizes:
            if size > best and self.is_stale(size, now, length):
                self._last_run[(size, length)] = now
                return size
        return best


def _by_shape(report: dict[str, Any]) -> dict[Shape, Any] | None:
    """A stage actor's compute per shape, from ``compute_by_shape`` or ``compute_by_rows``."""
    by_shape = report.get("compute_by_shape")
    if isinstance(by_shape, dict):
        shapes: dict[Shape, Any] = {}
        for key, entry in by_shape.items():
            rows, _, length = str(key).partition(",")
            shapes[(int(rows), int(length or 0))] = entry
        return shapes
    by_rows = report.get("compute_by_rows")
    if isinstance(by_rows, dict):
        return {(int(rows), 0): entry for rows, entry in by_rows.items()}
    return None


def _scaled(seconds: dict[Shape, float], shape: Shape) -> float:
    """The estimate of ``shape``, or the nearest measured shape's scaled linearly in rows (and in
    length, when only shorter lengths were measured): that overestimates large batches (per-row
    cost falls with batch size), erring on the SLO's side."""
    nearest = _nearest(seconds, shape)
    scale = shape[0] / nearest[0]
    if nearest[1] and shape[1] > nearest[1]:
        scale *= shape[1] / nearest[1]
    return seconds[nearest] * scale


def _nearest(shapes: dict[Shape, float], shape: Shape) -> Shape:
    """The measured shape an estimate of ``shape`` rests on: of its own length if measured,
    else the shortest measured length above it (a longer batch costs more: the estimate errs
    long), else the longest below; then the nearest row count, ties to the larger."""
    if shape in shapes:
        return shape
    size, length = shape
    lengths = {n for _, n in shapes}
    longer = [n for n in lengths if n >= length]
    chosen = min(longer) if longer else max(lengths)
    return min((s for s in shapes if s[1] == chosen), key=lambda s: (abs(s[0] - size), -s[0]))
