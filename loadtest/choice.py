"""Which batching timeout wins: pure functions over measured points, no I/O.

Per load level the winner is the setting with the highest throughput whose p99 meets the SLO
(and that failed almost no requests); when none meets it, the one with the lowest p99, marked
as missing the SLO. ``recommend`` picks one setting for all levels, and ``compare_auto`` checks
the adaptive timeout against the best fixed one.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

__all__ = [
    "AutoCheck",
    "Choice",
    "Point",
    "choose",
    "compare_auto",
    "medians",
    "recommend",
]

AUTO = "auto"
# A setting that fails more than this share of its requests does not "meet" anything: failed
# requests are often fast 503s that would flatter its p99.
MAX_FAILURE_RATIO = 0.01
# The bar for the adaptive timeout against the best fixed one.
AUTO_RPS_FLOOR = 0.9
AUTO_P99_CEILING = 1.1


@dataclass(frozen=True)
class Point:
    """One measured setting at one load level. ``rps`` counts successful requests only."""

    load: str
    timeout: str  # milliseconds as text, or "auto"
    max_batch_size: int | None
    requests: int
    failures: int
    rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_batch: float | None = None
    runs: int = 1  # how many runs this point is the median of

    @property
    def setting(self) -> tuple[str, int | None]:
        return (self.timeout, self.max_batch_size)

    @property
    def label(self) -> str:
        name = AUTO if self.timeout == AUTO else f"{self.timeout} ms"
        return name if self.max_batch_size is None else f"{name}, batch {self.max_batch_size}"

    @property
    def failure_ratio(self) -> float:
        return self.failures / self.requests if self.requests else 1.0

    def meets(self, slo_p99_ms: float | None) -> bool:
        if self.requests == 0 or self.failure_ratio > MAX_FAILURE_RATIO:
            return False
        return slo_p99_ms is None or self.p99_ms <= slo_p99_ms


@dataclass(frozen=True)
class Choice:
    load: str
    winner: Point
    meets_slo: bool
    note: str


@dataclass(frozen=True)
class AutoCheck:
    load: str
    auto: Point
    best_fixed: Point
    rps_ratio: float  # auto / best fixed
    p99_ratio: float  # auto / best fixed

    @property
    def ok(self) -> bool:
        return self.rps_ratio >= AUTO_RPS_FLOOR and self.p99_ratio <= AUTO_P99_CEILING


def loads_in_order(points: Iterable[Point]) -> list[str]:
    return list(dict.fromkeys(p.load for p in points))


def medians(runs: Sequence[Point]) -> list[Point]:
    """One point per (load, setting): the median of each figure over its runs, in first-run order.

    Requests and failures are summed, so the failure ratio covers every run. The figures are
    medians each on their own (the median p99 need not come from the median-throughput run):
    a single disturbed run moves neither.
    """
    groups: dict[tuple[str, str, int | None], list[Point]] = {}
    for run in runs:
        groups.setdefault((run.load, *run.setting), []).append(run)
    out = []
    for group in groups.values():
        batches = [p.mean_batch for p in group if p.mean_batch is not None]
        out.append(
            replace(
                group[0],
                requests=sum(p.requests for p in group),
                failures=sum(p.failures for p in group),
                rps=statistics.median(p.rps for p in group),
                p50_ms=statistics.median(p.p50_ms for p in group),
                p95_ms=statistics.median(p.p95_ms for p in group),
                p99_ms=statistics.median(p.p99_ms for p in group),
                mean_batch=statistics.median(batches) if batches else None,
                runs=sum(p.runs for p in group),
            )
        )
    return out


def pick(points: Sequence[Point], slo_p99_ms: float | None, load: str = "") -> Choice:
    """The winner among ``points`` (all of one load level); ``points`` must not be empty."""
    if not points:
        raise ValueError(f"no points measured at load {load!r}; expected at least one")
    meeting = [p for p in points if p.meets(slo_p99_ms)]
    if meeting:
        winner = max(meeting, key=lambda p: (p.rps, -p.p99_ms))
        note = "highest throughput" + (
            f" with p99 <= {slo_p99_ms:g} ms" if slo_p99_ms is not None else ""
        )
        return Choice(load, winner, True, note)
    winner = min(points, key=lambda p: (p.p99_ms, -p.rps))
    why = f"p99 <= {slo_p99_ms:g} ms" if slo_p99_ms is not None else "the failure limit"
    return Choice(load, winner, False, f"no setting meets {why}; lowest p99 shown")


def choose(points: Sequence[Point], slo_p99_ms: float | None) -> list[Choice]:
    """One ``Choice`` per load level, in the order the levels were measured."""
    return [
        pick([p for p in points if p.load == load], slo_p99_ms, load)
        for load in loads_in_order(points)
    ]


def compare_auto(points: Sequence[Point], slo_p99_ms: float | None) -> list[AutoCheck]:
    """Per load level with both kinds measured: the best auto point against the best fixed."""
    checks = []
    for load in loads_in_order(points):
        level = [p for p in points if p.load == load]
        autos = [p for p in level if p.timeout == AUTO]
        fixed = [p for p in level if p.timeout != AUTO]
        if not autos or not fixed:
            continue
        auto = pick(autos, slo_p99_ms, load).winner
        best = pick(fixed, slo_p99_ms, load).winner
        rps_ratio = auto.rps / best.rps if best.rps > 0 else float("inf")
        p99_ratio = auto.p99_ms / best.p99_ms if best.p99_ms > 0 else float("inf")
        checks.append(AutoCheck(load, auto, best, rps_ratio, p99_ratio))
    return checks


def recommend(
    points: Sequence[Point], slo_p99_ms: float | None
) -> tuple[tuple[str, int | None], str]:
    """One setting for every load level, and why.

    Among the settings that meet the SLO at every level (else among all), the one whose worst
    throughput relative to the best at each level is highest: it gives up the least anywhere.
    """
    if not points:
        raise ValueError("no points measured; expected at least one to recommend a setting")
    loads = loads_in_order(points)
    best_rps = {load: max(p.rps for p in points if p.load == load) for load in loads}
    by_setting: dict[tuple[str, int | None], dict[str, Point]] = {}
    for p in points:
        by_setting.setdefault(p.setting, {})[p.load] = p
    complete = {s: m for s, m in by_setting.items() if len(m) == len(loads)} or by_setting
    meeting = {s: m for s, m in complete.items() if all(p.meets(slo_p99_ms) for p in m.values())}
    pool = meeting or complete

    def score(item: tuple[tuple[str, int | None], dict[str, Point]]) -> tuple[float, float]:
        _, measured = item
        worst = min(
            p.rps / best_rps[p.load] if best_rps[p.load] > 0 else 0.0 for p in measured.values()
        )
        return (worst, -max(p.p99_ms for p in measured.values()))

    setting, measured = max(pool.items(), key=score)
    worst = score((setting, measured))[0]
    label = next(iter(measured.values())).label
    if meeting:
        why = f"{label} keeps at least {worst:.0%} of the best throughput at every load level"
        if slo_p99_ms is not None:
            why += f" with p99 <= {slo_p99_ms:g} ms"
    else:
        why = (
            f"no setting meets the SLO at every load level; {label} keeps at least {worst:.0%} "
            f"of the best throughput at every level"
        )
    return setting, why
