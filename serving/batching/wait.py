"""How long a queue head waits for more rows before its batch closes: the wait policies.

The batcher closes a batch when it is full (or when draining) on its own; everything else is the
policy's: whether a head that is not full may go now, how long it may wait (the batcher's
timer), and how many rows a batch may take. ``wait_policy`` picks the implementation from the
settings, once; the batcher never asks which one it has.

- ``FixedWait``: the oldest row waits at most ``batch_timeout_ms``.
- ``AutoWait`` (``batch_timeout_ms`` ``"auto"``): an idle pipeline gets each batch at once; while
  batches are in flight, a free slot waits for its share of the outstanding rows, at most one
  batch time, and never so long that the wait plus the predicted run time passes ``slo_p99_ms``.
  Why each rule, measured: docs/tuning.md (runs 3 to 5).

Pure arithmetic over what the batcher measured: no asyncio, no clock of its own.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from serving.batching.cost import RunTimeModel
    from serving.batching.settings import BatchSettings

__all__ = ["AutoWait", "FixedWait", "WaitPolicy", "wait_policy"]


class WaitPolicy(Protocol):
    def close_reason(
        self,
        policy: BatchSettings,
        *,
        rows: int,
        waited_s: float,
        inflight_batches: int,
        outstanding_rows: int,
        length: int = 0,
    ) -> str | None:
        """Why a head of ``rows`` rows (not a full batch), the oldest waiting ``waited_s``, may
        go now; None to keep waiting. ``length``: the bucket its batch would be length padded
        to (0 without length padding), for the cost of the batch."""

    def wait_s(
        self, policy: BatchSettings, rows: int, inflight_batches: int, length: int = 0
    ) -> float:
        """The longest a head of ``rows`` rows waits: the batcher wakes up by then."""

    def batch_limit(
        self, policy: BatchSettings, waited_s: float, now: float, queued: int, length: int = 0
    ) -> int:
        """The most rows the next batch takes, of the ``queued`` rows of its queue; ``now`` is
        the batcher's monotonic clock."""


def wait_policy(policy: BatchSettings, runtime: RunTimeModel) -> WaitPolicy:
    if policy.is_auto:
        return AutoWait(runtime)
    return FixedWait(float(policy.batch_timeout_ms))


class FixedWait:
    def __init__(self, timeout_ms: float) -> None:
        self.timeout_s = timeout_ms / 1000

    def close_reason(
        self,
        policy: BatchSettings,
        *,
        rows: int,
        waited_s: float,
        inflight_batches: int,
        outstanding_rows: int,
        length: int = 0,
    ) -> str | None:
        return "timeout" if waited_s >= self.timeout_s else None

    def wait_s(
        self, policy: BatchSettings, rows: int, inflight_batches: int, length: int = 0
    ) -> float:
        return self.timeout_s

    def batch_limit(
        self, policy: BatchSettings, waited_s: float, now: float, queued: int, length: int = 0
    ) -> int:
        return policy.max_batch_size


class AutoWait:
    def __init__(self, runtime: RunTimeModel) -> None:
        self.runtime = runtime

    def close_reason(
        self,
        policy: BatchSettings,
        *,
        rows: int,
        waited_s: float,
        inflight_batches: int,
        outstanding_rows: int,
        length: int = 0,
    ) -> str | None:
        if inflight_batches == 0:
            return "idle"  # nothing to overlap with
        # The rows the pipeline holds, spread over the batches it computes at once (one per
        # stage and replica), keep every stage busy while the queue refills; the extra
        # in-flight slot only hands a batch over, so it does not count.
        depth = min(policy.pipeline_depth, policy.max_inflight_batches)
        target = math.ceil(outstanding_rows / depth)
        if rows >= min(policy.max_batch_size, max(1, target)):
            return "target"
        if waited_s >= self.wait_s(policy, rows, inflight_batches, length):
            return "timeout"
        return None

    def cap_s(self) -> float:
        """The longest wait while batches are in flight: one batch time, the time in which the
        rows a closed loop waits for come back (a shorter cap shrank with the batches)."""
        return self.runtime.recent_s or 0.0

    def wait_s(
        self, policy: BatchSettings, rows: int, inflight_batches: int, length: int = 0
    ) -> float:
        if inflight_batches == 0:
            return 0.0
        wait_s = self.cap_s()
        if policy.slo_p99_ms is not None:
            size = policy.padded_size(min(rows, policy.max_batch_size))
            budget_s = policy.slo_p99_ms / 1000 - (self.runtime.predict(size, length) or 0.0)
            wait_s = min(wait_s, max(0.0, budget_s))
        return wait_s

    def batch_limit(
        self, policy: BatchSettings, waited_s: float, now: float, queued: int, length: int = 0
    ) -> int:
        """With an SLO, the largest batch predicted to finish within it (or, once in a while,
        a larger one not run for long, to measure it again)."""
        if policy.slo_p99_ms is None:
            return policy.max_batch_size
        budget_s = policy.slo_p99_ms / 1000 - waited_s
        # When even the smallest batch would miss the SLO, shrinking cannot save these rows
        # and would only cut throughput while overloaded: send a full batch instead.
        fitting = self.runtime.largest_within(budget_s, policy.padded_sizes(), now, queued, length)
        return fitting or policy.max_batch_size
