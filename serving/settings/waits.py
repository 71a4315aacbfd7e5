"""A wait in the settings (``batch_timeout_ms``, ``prefill_timeout_ms``): a number of ms from 0 to
``MAX_WAIT_MS``, or ``AUTO`` (the adaptive wait). One representation (``WaitMs``, parsed once at
the edge: a setting, a flag, an admin body), one parser and one ceiling for every wait."""

from __future__ import annotations

from typing import Any, Final, Literal

__all__ = ["AUTO", "MAX_WAIT_MS", "WaitMs", "is_auto", "parse_wait_ms", "wait_ceiling"]

MAX_WAIT_MS = 60_000
AUTO: Final = "auto"

# A wait as every layer holds it: a number of ms, or AUTO (the adaptive wait).
WaitMs = float | Literal["auto"]


def is_auto(wait: WaitMs) -> bool:
    return wait == AUTO


def parse_wait_ms(value: Any) -> WaitMs:
    """``"auto"`` (any case, spaces around), or the number of ms; anything else raises
    ``ValueError`` with the allowed range (pydantic reports it under the field's name)."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        ms = float(value)
    except (TypeError, ValueError):
        ms = float("nan")
    if not 0 <= ms <= MAX_WAIT_MS:
        raise ValueError(f"must be a number of ms between 0 and {MAX_WAIT_MS}, or 'auto'")
    return ms


def wait_ceiling(request_timeout_ms: float) -> tuple[float, bool]:
    """The longest wait a server with this request timeout takes, and whether that bound is
    itself allowed: below the request timeout (a wait that long answers nothing in time), and
    never above ``MAX_WAIT_MS``."""
    if request_timeout_ms <= MAX_WAIT_MS:
        return request_timeout_ms, False
    return MAX_WAIT_MS, True
