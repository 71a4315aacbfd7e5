"""A wait in the settings (``batch_timeout_ms``, ``prefill_timeout_ms``): a number of ms from 0 to
``MAX_WAIT_MS``, or ``"auto"`` (the adaptive wait). One parser and one ceiling for every wait."""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_WAIT_MS", "parse_wait_ms"]

MAX_WAIT_MS = 60_000


def parse_wait_ms(value: Any) -> float | str:
    """``"auto"`` (any case, spaces around), or the number of ms; anything else raises
    ``ValueError`` with the allowed range (pydantic reports it under the field's name)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        ms = float(value)
    except (TypeError, ValueError):
        ms = float("nan")
    if not 0 <= ms <= MAX_WAIT_MS:
        raise ValueError(f"must be a number of ms between 0 and {MAX_WAIT_MS}, or 'auto'")
    return ms
