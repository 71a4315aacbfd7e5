"""The last ``window_s`` seconds of one version's answered requests: how many, how many failed,
and their p99 latency. Times are the caller's clock (``time.monotonic()`` in the server, plain
floats in tests), never read here, and never go back.
"""

from __future__ import annotations

import numpy as np

__all__ = ["OutcomeWindow"]

_FIRST_CAPACITY = 1024
# The p99 is recomputed once 1 in this many of the window's requests changed.
_STALE_PER = 100


class OutcomeWindow:
    """A request answered at ``t`` counts while ``now - t < window_s``.

    The window lives in numpy arrays, not a deque of objects: 17 bytes a request (a 60 s window
    at 5k req/s is 5 MB, at most twice that allocated), a prune is a binary search, and the p99
    a partition of one slice (~2 ms for 300k requests; see ``p99_s`` for how often). Live
    entries are ``[_start, _end)``; the arrays are compacted to twice the live entries once the
    end reaches their capacity or they are 8 times too big, so an add costs O(1) amortised."""

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0 seconds, got {window_s!r}")
        self.window_s = float(window_s)
        self._times = np.empty(_FIRST_CAPACITY, dtype=np.float64)
        self._latencies = np.empty(_FIRST_CAPACITY, dtype=np.float64)
        self._failed = np.empty(_FIRST_CAPACITY, dtype=np.bool_)
        self._start = self._end = self._failures = 0
        self._p99: float | None = None
        self._changes = 0  # requests added or pruned since the p99 was computed

    def add(self, now: float, failed: bool, latency_s: float) -> None:
        self._prune(now)
        capacity = len(self._times)
        if self._end == capacity or (
            capacity > _FIRST_CAPACITY and (self._end - self._start) * 8 < capacity
        ):
            self._compact()
        end = self._end
        self._times[end] = now
        self._latencies[end] = latency_s
        self._failed[end] = failed
        self._end = end + 1
        self._failures += bool(failed)
        self._changes += 1

    def count(self, now: float) -> int:
        self._prune(now)
        return self._end - self._start

    def failures(self, now: float) -> int:
        """Failed answers in the window."""
        self._prune(now)
        return self._failures

    def failure_rate(self, now: float) -> float:
        """Failed / answered in the window; 0.0 when it is empty."""
        n = self.count(now)
        return self._failures / n if n else 0.0

    def p99_s(self, now: float) -> float | None:
        """The 99th percentile of the window's latencies, failed requests included, as
        ``numpy.percentile`` computes it (linear between the nearest ranks); ``None`` when the
        window is empty.

        It is the window's p99 as it was fewer than 1% of its requests ago: recomputed once 1%
        of them were added or left since (so on every change up to 100 requests). The
        controller judges after every request, and a fresh p99 of 300k requests on each would
        be ~2 ms a request; this way it is ~1 us a request, amortised."""
        self._prune(now)
        live = self._end - self._start
        if not live:
            self._p99, self._changes = None, 0
        elif self._changes and (self._p99 is None or self._changes * _STALE_PER >= live):
            window = self._latencies[self._start : self._end]
            self._p99, self._changes = float(np.percentile(window, 99.0)), 0
        return self._p99

    def clear(self) -> None:
        self._start = self._end = self._failures = 0
        self._p99, self._changes = None, 0

    def _prune(self, now: float) -> None:
        start, end = self._start, self._end
        oldest = now - self.window_s
        if start == end or self._times[start] > oldest:
            return
        # The first entry still inside: times are appended in order, so they are sorted.
        cut = start + int(np.searchsorted(self._times[start:end], oldest, side="right"))
        self._failures -= int(np.count_nonzero(self._failed[start:cut]))
        self._start = cut
        self._changes += cut - start

    def _compact(self) -> None:
        # Room for as many again as the window holds: grown when full, given back after a burst.
        start, end = self._start, self._end
        live = end - start
        capacity = _FIRST_CAPACITY
        while capacity < 2 * live:
            capacity *= 2
        for name in ("_times", "_latencies", "_failed"):
            old = getattr(self, name)
            new = old if capacity == len(old) else np.empty(capacity, dtype=old.dtype)
            new[:live] = old[start:end]  # numpy copies an overlapping slice correctly
            setattr(self, name, new)
        self._start, self._end = 0, live
