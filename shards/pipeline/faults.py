"""What went wrong with a batch, told apart at the ``shards`` boundary, and how long a batch may
run before the watchdog gives up on it.

Two kinds of failure need opposite answers. The model raising on a batch (``RayTaskError``) is
the batch's fault: the replica is fine, and retrying elsewhere would fail the same way. A stage
process dying or hanging is the replica's fault: the batch was never answered, so it is retried
once on another healthy replica (where there is one) while this one is recovered.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque

from shards.errors import ModelError, ReplicaLostError, RunError, StageTimeoutError, one_line

log = logging.getLogger(__name__)

# Exceptions that bad input raises inside an op: worth isolating the rows that trigger them.
# Others (out of memory, an internal error) are not the input's fault.
INPUT_ERRORS = frozenset(
    {
        "InvalidArgumentError",
        "OutOfRangeError",
        "ValueError",
        "TypeError",
        "IndexError",
        "KeyError",
        "FloatingPointError",
    }
)


def translate(exc: BaseException) -> RunError:
    """The one-line ``RunError`` for an exception out of a batch; the full detail is logged."""
    if isinstance(exc, RunError):
        return exc
    import ray.exceptions as rex

    if isinstance(exc, rex.RayTaskError):
        cause = exc.cause
        if isinstance(cause, RunError):
            # The stage said it in our own terms (shards.actor.stage_actor.ShardActor.forward).
            return cause
        if isinstance(cause, rex.RayError) and not isinstance(cause, rex.RayTaskError):
            return translate(cause)  # an upstream stage died: its error is passed down the chain
        root = cause if isinstance(cause, BaseException) else exc
        log.warning("the model raised on a batch:\n%s", exc)
        return ModelError(one_line(root), input_blamed=type(root).__name__ in INPUT_ERRORS)
    if isinstance(exc, TimeoutError) and not isinstance(exc, rex.RayError):
        return StageTimeoutError("the batch ran past the watchdog's limit")
    if isinstance(exc, rex.RayError):
        log.warning("a stage process failed under a batch: %s", exc)
        return ReplicaLostError(f"a stage process failed: {type(exc).__name__}")
    log.warning("a batch failed", exc_info=exc)
    return ModelError(one_line(exc), input_blamed=type(exc).__name__ in INPUT_ERRORS)


def is_replica_fault(error: RunError) -> bool:
    return isinstance(error, ReplicaLostError | StageTimeoutError)


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
