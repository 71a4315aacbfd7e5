"""A generating version's run-time knobs, one owner for all three (issue 41, item 3).

``GenerationKnobs`` holds the desired values; the scheduler reads them at every step boundary
and the admin route (``PUT /admin/models/{name}/generation``) and the tuner write through it.
Nothing else keeps a copy, so a change takes effect at the next step of every group.

- ``max_running_sequences``: the most sequences one replica runs at once (1 to its
  ``kv_slots``).
- ``prefill_timeout_ms``: how long the oldest waiting prompt may wait for others to join its
  prefill (``None``: auto; ``serving.generation.policy``'s two waits).
- ``prefill_budget_tokens``: the most prompt tokens that may join one step (``None``: no cap),
  so that a long prompt's prefill does not stall every running sequence for long. A prefill row
  is never cut (the stages prefill a row whole): the budget caps how many prompts join a step,
  and a prompt longer than the budget joins a step alone, so that it is never starved.

A value out of bounds raises ``ValueError`` naming it and its bounds, and changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from serving.generation.policy import PrefillWait, prefill_wait
from serving.settings.waits import MAX_WAIT_MS

__all__ = ["KNOBS", "MAX_PREFILL_BUDGET", "GenerationKnobs", "within_budget"]

KNOBS = ("max_running_sequences", "prefill_timeout_ms", "prefill_budget_tokens")

MAX_PREFILL_BUDGET = 1 << 20


class GenerationKnobs:
    def __init__(
        self,
        kv_slots: int,
        *,
        max_running_sequences: int | None = None,
        prefill_timeout_ms: float | None = None,
        prefill_budget_tokens: int | None = None,
    ) -> None:
        self.kv_slots = kv_slots
        self._changed: Callable[[], None] = lambda: None
        self._running = kv_slots
        self._timeout: float | None = None
        self._wait: PrefillWait = prefill_wait(None)
        self._budget: int | None = None
        self.change(
            max_running_sequences=max_running_sequences or kv_slots,
            prefill_timeout_ms=prefill_timeout_ms,
            prefill_budget_tokens=prefill_budget_tokens,
        )

    def on_change(self, listener: Callable[[], None]) -> None:
        """``listener`` runs after each change (the scheduler's wake-up: a waiting prompt may
        join now)."""
        self._changed = listener

    # ---- what the scheduler reads at each step

    @property
    def max_running_sequences(self) -> int:
        return self._running

    @property
    def prefill_timeout_ms(self) -> float | None:
        return self._timeout

    @property
    def prefill_wait(self) -> PrefillWait:
        return self._wait

    @property
    def prefill_budget_tokens(self) -> int | None:
        return self._budget

    # ---- what the admin route writes

    def change(self, **values: object) -> None:
        """Set some of the three (a ``prefill_timeout_ms`` of ``"auto"`` or ``None``: auto;
        a ``prefill_budget_tokens`` of ``None``: no cap). All are checked before any is set."""
        unknown = sorted(set(values) - set(KNOBS))
        if unknown:
            raise ValueError(f"unknown knob {unknown[0]!r}; expected some of {list(KNOBS)}")
        running, timeout, budget = self._running, self._timeout, self._budget
        if "max_running_sequences" in values:
            running = self._check_running(values["max_running_sequences"])
        if "prefill_timeout_ms" in values:
            timeout = self._check_timeout(values["prefill_timeout_ms"])
        if "prefill_budget_tokens" in values:
            budget = self._check_budget(values["prefill_budget_tokens"])
        self._running, self._budget = running, budget
        if timeout != self._timeout or "prefill_timeout_ms" in values:
            self._timeout, self._wait = timeout, prefill_wait(timeout)
        self._changed()

    def _check_running(self, value: object) -> int:
        slots = self.kv_slots
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= slots:
            raise ValueError(
                f"max_running_sequences must be an integer from 1 to kv_slots={slots}, got "
                f"{value!r:.40}; a running sequence holds a slot"
            )
        return value

    def _check_timeout(self, value: object) -> float | None:
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return None
        number = -1.0
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        if not (math.isfinite(number) and 0 <= number <= MAX_WAIT_MS):
            raise ValueError(
                f"prefill_timeout_ms must be a number of ms from 0 to {MAX_WAIT_MS}, or 'auto' "
                f"(or null), got {value!r:.40}"
            )
        return number

    def _check_budget(self, value: object) -> int | None:
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 1 <= value <= MAX_PREFILL_BUDGET
        ):
            raise ValueError(
                f"prefill_budget_tokens must be an integer from 1 to {MAX_PREFILL_BUDGET}, or "
                f"null for no cap, got {value!r:.40}"
            )
        return value


def within_budget(lengths: Iterable[int], budget: int | None, room: int) -> int:
    """How many of the waiting prompts (their prefill ``lengths``, queue order) may join one step
    under a prefill ``budget`` of tokens, at most ``room``: those that fit in order; the first
    alone when it is longer than the whole budget (it is never starved)."""
    if budget is None:
        return room
    taken = used = 0
    for length in lengths:
        if taken >= room:
            break
        if used + length > budget and taken:
            break
        taken += 1
        used += length
        if used >= budget:
            break
    return taken
