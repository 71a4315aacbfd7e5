"""The elastic bench's figures, read from the replies and the sampled gauges (pure).

Stages are named spans of the load: ``low`` (0.5x one replica's capacity), ``high`` (2.5x),
``quiet`` (0.5x again, where the replicas must come down) and ``steady`` (1.5x). Read:

- high: seconds from its start until the p99 (failures as infinitely slow, in ``window_s``
  windows) stays under the target to the stage's end; goodput and the 503 share from then on
  ("once scaled") and over the whole stage;
- quiet: failed requests (target 0), the seconds until the replicas are back at the minimum
  (every replica counted, whatever its state) and the scale-down events;
- steady: the scale events in it and how often the healthy count changed (target: at most once).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.load.replies import back_under, p99_windows, summarize
from bench.load.timeline import Reply
from bench.observe.sampler import Sample, changes, total

REPLICAS = "shardserve_replicas"
EVENTS = "shardserve_scale_events_total"
STATES = ("healthy", "starting", "pending", "draining", "suspect", "dead")


def replicas_at(sample: Sample) -> dict[str, float]:
    """The sample's replicas by state (summed over versions)."""
    return {state: total(sample.series, REPLICAS, state=state) for state in STATES}


def replica_total(series: dict[str, float]) -> float:
    """Every replica of the series, whatever its state."""
    return sum(total(series, REPLICAS, state=state) for state in STATES)


def events(sample: Sample | None, direction: str) -> float:
    return 0.0 if sample is None else total(sample.series, EVENTS, direction=direction)


def last_before(samples: Sequence[Sample], t: float) -> Sample | None:
    """The last sample taken at or before ``t``."""
    before = [s for s in samples if s.t_s <= t]
    return before[-1] if before else None


def in_span(samples: Sequence[Sample], lo: float, hi: float) -> list[Sample]:
    return [s for s in samples if lo <= s.t_s < hi]


def healthy_changes(samples: Sequence[Sample], lo: float, hi: float) -> list[tuple[float, float]]:
    """(t, healthy replicas) at each change inside [lo, hi), the value at ``lo`` first."""
    start = last_before(samples, lo)
    kept = ([start] if start else []) + in_span(samples, lo, hi)
    return changes([(s.t_s, total(s.series, REPLICAS, state="healthy")) for s in kept])


def high_stage(
    replies: Sequence[Reply],
    span: tuple[float, float],
    rate: float,
    target_ms: float,
    window_s: float,
) -> dict[str, Any]:
    lo, hi = span
    recovered = back_under(replies, lo, hi, target_ms, window_s)
    scaled = summarize(replies, lo + recovered, hi) if recovered is not None else None
    return {
        "whole": summarize(replies, lo, hi),
        "to_p99_under_target_s": recovered,
        "once_scaled": scaled,
        "goodput_ratio": (scaled["goodput_rps"] / rate) if scaled and rate else None,
        "p99_windows": p99_windows(replies, lo, hi, window_s),
    }


def quiet_stage(
    replies: Sequence[Reply], samples: Sequence[Sample], span: tuple[float, float], minimum: int
) -> dict[str, Any]:
    lo, hi = span
    after = [s for s in samples if s.t_s >= lo]
    at_min = next(
        (s.t_s for s in after if sum(replicas_at(s).values()) <= minimum),
        None,
    )
    first, last = (
        last_before(samples, lo),
        last_before(samples, hi) or (after[-1] if after else None),
    )
    return {
        "whole": summarize(replies, lo, hi),
        "to_min_replicas_s": None if at_min is None else round(at_min - lo, 3),
        "scale_down_events": events(last, "down") - events(first, "down"),
    }


def steady_stage(
    replies: Sequence[Reply], samples: Sequence[Sample], span: tuple[float, float]
) -> dict[str, Any]:
    lo, hi = span
    first = last_before(samples, lo)
    last = samples[-1] if samples else None
    seen = healthy_changes(samples, lo, hi)
    return {
        "whole": summarize(replies, lo, hi),
        "scale_events": sum(events(last, d) - events(first, d) for d in ("up", "down")),
        "healthy_changes": max(len(seen) - 1, 0),
        "healthy_over_time": seen,
    }


def summarize_elastic(
    replies: Sequence[Reply],
    samples: Sequence[Sample],
    stages: dict[str, tuple[float, float]],
    rates: dict[str, float],
    *,
    target_ms: float,
    window_s: float,
    minimum: int,
) -> dict[str, Any]:
    """Every stage's figures, and the healthy replicas over the whole run."""
    out: dict[str, Any] = {
        "requests": len(replies),
        "failed": sum(1 for r in replies if not r.ok),
        "replicas_over_time": changes(
            [(s.t_s, total(s.series, REPLICAS, state="healthy")) for s in samples]
        ),
    }
    if "low" in stages:
        out["low"] = {"whole": summarize(replies, *stages["low"])}
    if "high" in stages:
        out["high"] = high_stage(replies, stages["high"], rates["high"], target_ms, window_s)
        peak = [replicas_at(s)["healthy"] for s in in_span(samples, *stages["high"])]
        out["high"]["max_healthy"] = max(peak, default=None)
    if "quiet" in stages:
        out["quiet"] = quiet_stage(replies, samples, stages["quiet"], minimum)
    if "steady" in stages:
        out["steady"] = steady_stage(replies, samples, stages["steady"])
    return out
