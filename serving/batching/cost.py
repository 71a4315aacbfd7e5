"""What a batch of each size costs, from the stage actors' compute times: the cost model the auto
wait policy (``serving.batching.wait.AutoWait``) reads to honour ``slo_p99_ms``, and the batcher
reads for its ``Retry-After`` hint.
"""

from __future__ import annotations

import math
from typing import Any

_EWMA_ALPHA = 0.2
# A batch size that has not run for this long may run once to be measured again.
STALE_S = 10.0


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
    again instead of being ruled out for good.
    """

    def __init__(self, stale_s: float = STALE_S) -> None:
        self.stale_s = stale_s
        self._wall: dict[int, float] = {}  # EWMA of the driver's wall time per padded size
        self._latency: dict[int, float] = {}  # per size: the stages' compute summed
        self._bottleneck: dict[int, float] = {}  # per size: the slowest stage's compute
        self._idle_over_s: float | None = None  # EWMA of wall - compute, idle pipeline
        self._least_over_s: float | None = None  # the least wall - compute seen, any load
        self._last_run: dict[int, float] = {}  # size -> when a batch of it last ran or probed
        self.recent_s: float | None = None  # EWMA over batches of any size (wall)

    def observe(
        self, padded_size: int, run_s: float, *, now: float | None = None, alone: bool = False
    ) -> None:
        """A batch's wall time in the driver; ``alone``: sent while no other batch ran."""
        old = self._wall.get(padded_size)
        self._wall[padded_size] = run_s if old is None else old + _EWMA_ALPHA * (run_s - old)
        recent = self.recent_s
        self.recent_s = run_s if recent is None else recent + _EWMA_ALPHA * (run_s - recent)
        if now is not None:
            self._last_run[padded_size] = now
        compute = self._latency.get(padded_size)
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
        with ``stage_index`` and ``compute_by_rows`` ({rows: {"ewma_ms", "count"}}); replicas
        of a stage are averaged. A size enters once every stage has run it."""
        per_stage: dict[int, dict[int, list[float]]] = {}
        for report in stage_stats:
            by_rows = report.get("compute_by_rows")
            if not isinstance(by_rows, dict):
                continue
            stage = per_stage.setdefault(int(report.get("stage_index", 0)), {})
            for rows, entry in by_rows.items():
                if isinstance(entry, dict) and entry.get("count"):
                    stage.setdefault(int(rows), []).append(float(entry["ewma_ms"]) / 1000)
        if not per_stage:
            return
        stages = [{n: sum(v) / len(v) for n, v in s.items()} for s in per_stage.values()]
        common = set.intersection(*(set(s) for s in stages))
        self._latency = {n: sum(s[n] for s in stages) for n in common}
        self._bottleneck = {n: max(s[n] for s in stages) for n in common}

    @property
    def hop_s(self) -> float:
        """A batch's time outside the stages' compute: from idle batches, else the least seen."""
        if self._idle_over_s is not None:
            return self._idle_over_s
        return self._least_over_s or 0.0

    def predict(self, padded_size: int) -> float | None:
        """Seconds from sending a batch of ``padded_size`` to its answer with nothing queued
        ahead of it; ``None`` before any batch."""
        if self._latency:
            return _scaled(self._latency, padded_size) + self.hop_s
        return _scaled(self._wall, padded_size) if self._wall else None

    def bottleneck_s(self, padded_size: int) -> float | None:
        """Seconds between batches of ``padded_size`` leaving a busy pipeline."""
        if self._bottleneck:
            return _scaled(self._bottleneck, padded_size)
        return self.predict(padded_size)

    def view(self, sizes: tuple[int, ...]) -> dict[str, Any]:
        """Milliseconds per size: predicted latency and bottleneck; the hop; from compute?"""

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000, 3)

        return {
            "from_compute": bool(self._latency),
            "hop": ms(self.hop_s),
            "latency": {str(size): ms(self.predict(size)) for size in sizes},
            "bottleneck": {str(size): ms(self.bottleneck_s(size)) for size in sizes},
        }

    def is_stale(self, size: int, now: float) -> bool:
        """The measurement ``predict(size)`` rests on (its own, or the nearest size's) is from a
        batch older than ``stale_s``, and no batch of ``size`` ran since."""
        measured = self._latency or self._wall
        if not measured:
            return False
        source = _nearest(measured, size)
        last = max(self._last_run.get(source, -math.inf), self._last_run.get(size, -math.inf))
        return now - last >= self.stale_s

    def largest_within(
        self,
        budget_s: float,
        sizes: tuple[int, ...],
        now: float | None = None,
        queued: int | None = None,
    ) -> int | None:
        """The largest of ``sizes`` predicted to finish within ``budget_s``; None if none is.

        With nothing measured every size fits, so the auto policy batches as it would without
        an SLO. Given ``now`` and more ``queued`` rows than that size, the smallest larger size
        whose estimate is stale is returned instead, once per ``stale_s``: one batch measures
        it again.
        """
        best = None
        for size in sizes:
            predicted = self.predict(size)
            if predicted is None or predicted <= budget_s:
                best = size
        if now is None or queued is None or best is None or queued <= best:
            return best
        for size in sizes:
            if size > best and self.is_stale(size, now):
                self._last_run[size] = now
                return size
        return best


def _scaled(seconds: dict[int, float], size: int) -> float:
    """The estimate of ``size``, or the nearest measured size's scaled linearly: that
    overestimates large batches (per-row cost falls with batch size), erring on the SLO's side."""
    nearest = _nearest(seconds, size)
    return seconds[nearest] * size / nearest


def _nearest(sizes: dict[int, float], size: int) -> int:
    if size in sizes:
        return size
    return min(sizes, key=lambda s: (abs(s - size), -s))
