"""How long a batch may run on a replica, and the clock that times it.

``Watchdog`` sets the limit per batch size; ``BatchClock`` starts a batch's clock when stage 0
starts the batch, not when it was handed to the replica: the time it queued behind other batches
(in the compiled graph's semaphore, in the actors' queues) is theirs, and counting it would let a
load spike get a healthy replica killed. Stages take batches in order, so a batch starts in stage
0 once the batch before it has left stage 0. The driver learns that when stage 0's output exists,
from the task's reply (``set_when_ready``): no fetch and no extra call per batch (measured: driver
CPU per batch unchanged within noise; a callback on a tiny extra return, fetched, cost 0.1-0.3
ms). A compiled graph's outputs come back all at once, so there a batch starts when the one
before it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import ray

# Ray 2.60's way to learn that a task's return exists without fetching it (stage 0's outputs
# stay on its node). Without it a batch's clock starts when the batch before it is done.
ON_READY = hasattr(ray.ObjectRef, "_on_ready")


class Watchdog:
    """The longest a batch of ``rows`` rows may run, timed from when its first stage starts it.

    ``fixed_s`` when set; else ``factor`` x the p99 of recent batches of the same size, never
    under ``floor_s``. A size with too few batches yet is judged by the largest size that has
    enough, scaled by rows (compute grows with the batch); ``start_s`` until some size has.
    Sizes are apart because one limit for all would be set by the small batches of a quiet
    spell and kill the first large batch of a spike (or of a larger ``max_batch_size``).
    """

    def __init__(
        self,
        fixed_s: float | None = None,
        *,
        factor: float = 10.0,
        floor_s: float = 5.0,
        start_s: float = 60.0,
        min_samples: int = 20,
        window: int = 128,
        max_sizes: int = 1024,
    ) -> None:
        if fixed_s is not None and fixed_s <= 0:
            raise ValueError(f"the batch hard timeout must be > 0 s or None, got {fixed_s}")
        self.fixed_s = fixed_s
        self._factor = factor
        self._floor_s = floor_s
        self._start_s = start_s
        self._min_samples = min_samples
        self._window = window
        self._max_sizes = max_sizes
        # Least recently observed size first: past ``max_sizes`` it goes.
        self._sizes: OrderedDict[int, _SizeTimes] = OrderedDict()
        self._largest: int | None = None  # the largest size with a p99

    def observe(self, rows: int, seconds: float) -> None:
        if self.fixed_s is not None:
            return
        times = self._sizes.get(rows)
        if times is None:
            times = self._sizes[rows] = _SizeTimes(self._window)
        else:
            self._sizes.move_to_end(rows)
        if times.add(seconds, self._min_samples) and (
            self._largest is None or rows > self._largest
        ):
            self._largest = rows
        if len(self._sizes) > self._max_sizes:
            gone, _ = self._sizes.popitem(last=False)
            if gone == self._largest:
                judged = [r for r, t in self._sizes.items() if t.p99 is not None]
                self._largest = max(judged, default=None)

    def limit_s(self, rows: int) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        times = self._sizes.get(rows)
        if times is not None and times.p99 is not None:
            return max(self._floor_s, self._factor * times.p99)
        if self._largest is None:
            return self._start_s
        p99 = self._sizes[self._largest].p99
        assert p99 is not None
        return max(self._floor_s, self._factor * p99 * rows / self._largest)


class _SizeTimes:
    """The recent run times of batches of one size, and their p99 once there are enough."""

    def __init__(self, window: int) -> None:
        self.times: deque[float] = deque(maxlen=window)
        self.p99: float | None = None
        self._seen = 0

    def add(self, seconds: float, min_samples: int) -> bool:
        """Record one time; True when the p99 was (re)computed."""
        self.times.append(seconds)
        self._seen += 1
        # Sorting the window on every batch would cost more than the batch's bookkeeping.
        if self._seen < min_samples or (self._seen > min_samples and self._seen % 16):
            return False
        ordered = sorted(self.times)
        self.p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        return True


def set_when_ready(ref: Any, left: asyncio.Future[None]) -> None:
    """Set ``left`` once ``ref`` exists (or its task failed), without fetching it."""
    loop = asyncio.get_running_loop()

    def ready(_: BaseException | None) -> None:
        # On one of Ray's threads; the loop may be closed by now (a shutdown).
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_set, left)

    ref._on_ready(ready)


def _set(left: asyncio.Future[None]) -> None:
    if not left.done():
        left.set_result(None)


class BatchClock:
    """One batch's watchdog: no limit while the batch waits for stage 0, then its size's limit
    from when stage 0 starts it (``scope`` is the ``asyncio.timeout`` around the batch)."""

    def __init__(self, scope: asyncio.Timeout, limit_s: Callable[[], float | None]) -> None:
        self._scope = scope
        self._limit_s = limit_s
        self.limit_s: float | None = None
        self.started: float | None = None
        self.left: asyncio.Future[None] | None = None
        self._stopped = False

    def start(self) -> None:
        if self._stopped or self.started is not None:
            return
        loop = asyncio.get_running_loop()
        self.started = loop.time()
        self.limit_s = self._limit_s()
        if self.limit_s is not None:
            self._scope.reschedule(self.started + self.limit_s)

    def elapsed_s(self) -> float:
        assert self.started is not None
        return asyncio.get_running_loop().time() - self.started

    def stop(self) -> None:
        """The batch is over: its clock never starts now, and the next batch's does."""
        self._stopped = True
        if self.left is not None and not self.left.done():
            self.left.set_result(None)
