"""What went wrong with a batch, told apart at the ``shards`` boundary, and how long a batch may
run before the watchdog gives up on it.

Two kinds of failure need opposite answers. The model raising on a batch (``RayTaskError``) is
the batch's fault: the replica is fine, and retrying elsewhere would fail the same way. A stage
process dying or hanging is the replica's fault: the batch was never answered, so it is retried
once on another replica while this one is recovered.
"""

from __future__ import annotations

import logging
import math
from collections import deque

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
            return cause  # the stage said it in our own terms (shards.actor.ShardActor.forward)
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
    """The longest a batch may take: ``fixed_s`` when set, else ``factor`` x the p99 of recent
    batch times, never under ``floor_s``; ``start_s`` until enough batches were seen."""

    def __init__(
        self,
        fixed_s: float | None = None,
        *,
        factor: float = 10.0,
        floor_s: float = 5.0,
        start_s: float = 60.0,
        min_samples: int = 20,
        window: int = 512,
    ) -> None:
        if fixed_s is not None and fixed_s <= 0:
            raise ValueError(f"the batch hard timeout must be > 0 s or None, got {fixed_s}")
        self.fixed_s = fixed_s
        self._factor = factor
        self._floor_s = floor_s
        self._start_s = start_s
        self._min_samples = min_samples
        self._times: deque[float] = deque(maxlen=window)
        self._limit_s = fixed_s if fixed_s is not None else start_s
        self._seen = 0

    def observe(self, seconds: float) -> None:
        self._times.append(seconds)
        self._seen += 1
        # Sorting the window costs ~0.1 ms: once every 32 batches, not on each one.
        if (
            self.fixed_s is None
            and len(self._times) >= self._min_samples
            and (self._seen % 32 == 0 or len(self._times) == self._min_samples)
        ):
            ordered = sorted(self._times)
            p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
            self._limit_s = max(self._floor_s, self._factor * p99)

    @property
    def limit_s(self) -> float:
        return self._limit_s
