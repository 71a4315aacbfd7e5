"""Which generation knobs win: pure functions over measured points, no I/O (the generation
tuner's ``loadtest.choice``).

A setting is (``prefill_timeout_ms``, ``max_running_sequences``, ``prefill_budget_tokens``). It
meets the targets at a load level when its TTFT p95 and its time-per-output-token p95 are within
them and it failed almost no streams. Per load level the winner is the meeting setting with the
most output tokens/s; when none meets them, the one that misses them least (its worst ratio of
figure to target). ``recommend`` picks one setting for every level: among those that meet the
targets at every level (else among all), the one that gives up the least tokens/s relative to
the best at each level; when none meets them everywhere, the one that misses least.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = [
    "AUTO",
    "GenChoice",
    "GenPoint",
    "Targets",
    "choose",
    "medians",
    "recommend",
]

AUTO = "auto"
NO_CAP = "none"
MAX_FAILURE_RATIO = 0.01

Setting = tuple[str, int, int | None]  # prefill timeout, running limit, budget


@dataclass(frozen=True)
class Targets:
    """p95 targets in ms (``None``: none for that figure)."""

    ttft_p95_ms: float | None = None
    tpot_p95_ms: float | None = None

    def describe(self) -> str:
        parts = []
        if self.ttft_p95_ms is not None:
            parts.append(f"TTFT p95 <= {self.ttft_p95_ms:g} ms")
        if self.tpot_p95_ms is not None:
            parts.append(f"TPOT p95 <= {self.tpot_p95_ms:g} ms")
        return " and ".join(parts) or "no latency target (most tokens/s wins)"


@dataclass(frozen=True)
class GenPoint:
    """One setting measured at one load level (``users`` streaming clients, closed loop)."""

    load: str
    prefill_timeout_ms: str  # ms as text, or "auto"
    max_running_sequences: int
    prefill_budget_tokens: int | None  # None: no cap
    streams: int
    failures: int
    tokens_per_s: float
    streams_per_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    tpot_p50_ms: float | None
    tpot_p95_ms: float | None
    rows_per_step: float | None = None  # the server's, warm-up included
    runs: int = 1

    @property
    def setting(self) -> Setting:
        return (self.prefill_timeout_ms, self.max_running_sequences, self.prefill_budget_tokens)

    @property
    def label(self) -> str:
        wait = AUTO if self.prefill_timeout_ms == AUTO else f"{self.prefill_timeout_ms} ms"
        budget = NO_CAP if self.prefill_budget_tokens is None else str(self.prefill_budget_tokens)
        return f"wait {wait}, running {self.max_running_sequences}, budget {budget}"

    @property
    def failure_ratio(self) -> float:
        return self.failures / self.streams if self.streams else 1.0

    def excess(self, targets: Targets) -> float:
        """The worst of figure / target (<= 1: within both); inf for a point that failed or
        measured nothing."""
        if self.streams == 0 or self.failure_ratio > MAX_FAILURE_RATIO:
            return float("inf")
        worst = 0.0
        for value, target in (
            (self.ttft_p95_ms, targets.ttft_p95_ms),
            (self.tpot_p95_ms, targets.tpot_p95_ms),
        ):
            if target is None:
                continue
            if value is None:
                return float("inf")
            worst = max(worst, value / target)
        return worst

    def meets(self, targets: Targets) -> bool:
        return self.excess(targets) <= 1.0


@dataclass(frozen=True)
class GenChoice:
    load: str
    winner: GenPoint
    meets: bool
    note: str


def loads_in_order(points: Sequence[GenPoint]) -> list[str]:
    return list(dict.fromkeys(p.load for p in points))


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def medians(runs: Sequence[GenPoint]) -> list[GenPoint]:
    """One point per (load, setting): each figure's median over its runs; streams and failures
    summed."""
    groups: dict[tuple[str, Setting], list[GenPoint]] = {}
    for run in runs:
        groups.setdefault((run.load, run.setting), []).append(run)
    return [
        replace(
            group[0],
            streams=sum(p.streams for p in group),
            failures=sum(p.failures for p in group),
            tokens_per_s=statistics.median(p.tokens_per_s for p in group),
            streams_per_s=statistics.median(p.streams_per_s for p in group),
            ttft_p50_ms=_median([p.ttft_p50_ms for p in group]),
            ttft_p95_ms=_median([p.ttft_p95_ms for p in group]),
            tpot_p50_ms=_median([p.tpot_p50_ms for p in group]),
            tpot_p95_ms=_median([p.tpot_p95_ms for p in group]),
            rows_per_step=_median([p.rows_per_step for p in group]),
            runs=sum(p.runs for p in group),
        )
        for group in groups.values()
    ]


def pick(points: Sequence[GenPoint], targets: Targets, load: str = "") -> GenChoice:
    """The winner among ``points`` of one load level; ``points`` must not be empty."""
    if not points:
        raise ValueError(f"no points measured at load {load!r}; expected at least one")
    meeting = [p for p in points if p.meets(targets)]
    if meeting:
        winner = max(meeting, key=lambda p: (p.tokens_per_s, -p.excess(targets)))
        return GenChoice(load, winner, True, f"most tokens/s with {targets.describe()}")
    winner = min(points, key=lambda p: (p.excess(targets), -p.tokens_per_s))
    return GenChoice(
        load, winner, False, f"no setting meets {targets.describe()}; the one that misses least"
    )


def choose(points: Sequence[GenPoint], targets: Targets) -> list[GenChoice]:
    """One ``GenChoice`` per load level, in the order the levels were measured."""
    return [
        pick([p for p in points if p.load == load], targets, load)
        for load in loads_in_order(points)
    ]


def recommend(points: Sequence[GenPoint], targets: Targets) -> tuple[GenPoint, bool, str]:
    """One setting for every load level (as its point at the first level it was measured), whether
    it meets the targets at every level, and why."""
    if not points:
        raise ValueError("no points measured; expected at least one to recommend a setting")
    loads = loads_in_order(points)
    best = {load: max(p.tokens_per_s for p in points if p.load == load) for load in loads}
    by_setting: dict[Setting, dict[str, GenPoint]] = {}
    for p in points:
        by_setting.setdefault(p.setting, {})[p.load] = p
    complete = {s: m for s, m in by_setting.items() if len(m) == len(loads)} or by_setting
    meeting = {s: m for s, m in complete.items() if all(p.meets(targets) for p in m.values())}

    def kept(measured: dict[str, GenPoint]) -> float:
        return min(
            p.tokens_per_s / best[p.load] if best[p.load] > 0 else 0.0 for p in measured.values()
        )

    def missed(measured: dict[str, GenPoint]) -> float:
        return max(p.excess(targets) for p in measured.values())

    if meeting:
        _, measured = max(meeting.items(), key=lambda i: (kept(i[1]), -missed(i[1])))
        first = next(iter(measured.values()))
        why = (
            f"{first.label} meets {targets.describe()} at every load level and keeps at least "
            f"{kept(measured):.0%} of the best tokens/s at each"
        )
        return first, True, why
    _, measured = min(complete.items(), key=lambda i: (missed(i[1]), -kept(i[1])))
    first = next(iter(measured.values()))
    worst = missed(measured)
    how = (
        "failed streams or measured none at some level"
        if worst == float("inf")
        else f"its worst figure is {worst:.2f}x its target"
    )
    why = (
        f"no setting meets {targets.describe()} at every load level; {first.label} misses it "
        f"least ({how}) and keeps {kept(measured):.0%} of the best tokens/s"
    )
    return first, False, why
