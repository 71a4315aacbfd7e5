"""Who joins a step: the scheduler's policy, apart from its mechanism (vLLM's split).

Pure arithmetic over what the scheduler counted: no asyncio, no clock of its own.

- ``admit_count``: how many waiting prompts a group may take at its step boundary (its share of
  the replica's running limit, within the replica's free slots).
- When a prefill starts (``prefill_wait``, from ``prefill_timeout_ms``), the batcher's two wait
  policies for prompts:
  ``FixedPrefillWait`` (a number of ms): the prompts start once they fill what the group
  may take, or once the oldest waited the timeout; ``AutoPrefillWait`` (``auto``, as the
  batcher's: an idle pipeline gets its batch at once): an idle group takes the queue at once, a
  busy one at its next step boundary (the prompts join that step beside its decode rows, so
  holding them back would save no step).
"""

from __future__ import annotations

import math
from typing import Protocol

__all__ = ["AutoPrefillWait", "FixedPrefillWait", "PrefillWait", "admit_count", "prefill_wait"]


class PrefillWait(Protocol):
    def wait_s(self, *, waited_s: float, waiting: int, room: int, busy: bool) -> float:
        """How much longer the oldest of ``waiting`` prompts (waited ``waited_s``) waits before
        a group with ``room`` for new ones starts their prefill; 0: now. ``busy``: the group
        has running sequences (its next step happens anyway)."""
        ...


class FixedPrefillWait:
    def __init__(self, timeout_ms: float) -> None:
        self.timeout_s = timeout_ms / 1000.0

    def wait_s(self, *, waited_s: float, waiting: int, room: int, busy: bool) -> float:
        if waiting >= room:  # full: no later prompt could join this prefill
            return 0.0
        return max(0.0, self.timeout_s - waited_s)


class AutoPrefillWait:
    def wait_s(self, *, waited_s: float, waiting: int, room: int, busy: bool) -> float:
        return 0.0


def prefill_wait(timeout_ms: float | None) -> PrefillWait:
    """``None``: auto."""
    return AutoPrefillWait() if timeout_ms is None else FixedPrefillWait(timeout_ms)


def admit_count(*, limit: int, groups: int, in_group: int, on_replica: int, slots_free: int) -> int:
    """The most prompts a group may take now: up to its share of the replica's ``limit`` of
    running sequences (``ceil(limit / groups)``, so that every group of the pipeline holds
    work), within the replica's limit and its free slots."""
    share = math.ceil(limit / groups) - in_group
    return max(0, min(share, limit - on_replica, slots_free))
