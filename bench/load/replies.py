"""What a timeline's replies say: counts, latency, goodput and 503s over a span of due times,
the p99 window by window (and when it came back under a target), and which version answered.

Pure: lists of ``bench.load.timeline.Reply`` in, numbers out. A failed request counts in a
window's p99 as an infinitely slow one: a window where more than 1% failed is not "under target".
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from bench.load.timeline import Reply


def percentiles(values: Iterable[float]) -> dict[str, float]:
    """n, p50, p99, max (only n when there is none)."""
    kept = list(values)
    if not kept:
        return {"n": 0}
    p50, p99 = (float(v) for v in np.percentile(kept, [50, 99]))
    return {"n": len(kept), "p50": p50, "p99": p99, "max": float(max(kept))}


def within(replies: Iterable[Reply], lo: float, hi: float) -> list[Reply]:
    """The replies of the requests due in [lo, hi)."""
    return [r for r in replies if lo <= r.due_s < hi]


def summarize(replies: Sequence[Reply], lo: float, hi: float) -> dict[str, Any]:
    """The requests due in [lo, hi): counts by status, goodput, the 503 share, latency of the
    answered ones."""
    span = within(replies, lo, hi)
    seconds = max(hi - lo, 1e-9)
    ok = [r for r in span if r.ok]
    statuses = Counter(r.status for r in span)
    return {
        "from_s": round(lo, 3),
        "to_s": round(hi, 3),
        "requests": len(span),
        "ok": len(ok),
        "failed": len(span) - len(ok),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "offered_rps": len(span) / seconds,
        "goodput_rps": len(ok) / seconds,
        "share_503": statuses.get(503, 0) / len(span) if span else 0.0,
        "latency_ms": percentiles(r.latency_ms for r in ok),
    }


def p99_ms(replies: Sequence[Reply]) -> float | None:
    """The p99 latency, failures counted as infinitely slow; None when there is no reply."""
    if not replies:
        return None
    values = [r.latency_ms if r.ok else math.inf for r in replies]
    return float(np.percentile(values, 99, method="higher"))


def p99_windows(
    replies: Sequence[Reply], lo: float, hi: float, window_s: float
) -> list[tuple[float, float | None, int]]:
    """(window start, p99 ms or None, requests) for consecutive windows of due times."""
    out = []
    start = lo
    while start < hi - 1e-9:
        end = min(start + window_s, hi)
        span = within(replies, start, end)
        out.append((round(start, 3), p99_ms(span), len(span)))
        start = end
    return out


def back_under(
    replies: Sequence[Reply], lo: float, hi: float, target_ms: float, window_s: float
) -> float | None:
    """Seconds from ``lo`` to the start of the first window after which every window up to
    ``hi`` has its p99 under ``target_ms`` (None when the last window is over it)."""
    windows = p99_windows(replies, lo, hi, window_s)
    since: float | None = None
    for start, p99, _ in windows:
        if p99 is not None and p99 > target_ms:
            since = None
        elif since is None:
            since = start
    return None if since is None else round(since - lo, 3)


def first_answer_s(replies: Iterable[Reply], version: str) -> float | None:
    """When the first answer from ``version`` came back (its completion time)."""
    times = [r.done_s for r in replies if r.ok and r.version == version]
    return min(times) if times else None


def answers_after(replies: Iterable[Reply], version: str, since_s: float) -> int:
    """Answers from ``version`` to requests sent after ``since_s``."""
    return sum(1 for r in replies if r.ok and r.version == version and r.due_s > since_s)


def by_version(replies: Iterable[Reply]) -> dict[str, dict[str, Any]]:
    """Per answering version ("" for failures): the count and latency."""
    groups: dict[str, list[float]] = {}
    for r in replies:
        groups.setdefault(r.version if r.ok else "", []).append(r.latency_ms)
    return {k: percentiles(v) for k, v in sorted(groups.items())}


def failures(replies: Iterable[Reply], per_status: int = 3) -> list[dict[str, Any]]:
    """The first few failed replies of each status."""
    seen: Counter[int] = Counter()
    out = []
    for r in replies:
        if r.ok:
            continue
        seen[r.status] += 1
        if seen[r.status] <= per_status:
            out.append(asdict(r))
    return out
