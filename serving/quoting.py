"""Client data quoted in an answer or a log line, always cut short.

A model name, an input name, a label or a list of keys comes from the request and may be as
long as the body (16 MiB): quoted whole, one request wrote a line that long into the log and
the answer, per call. Every message built from client data quotes it through ``quote`` (one
value) or ``quote_all`` (a list of them): at most ``MAX_QUOTED`` characters of a value and
``MAX_LISTED`` values of a list, with what was left out counted.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable
from typing import Any

__all__ = ["MAX_LISTED", "MAX_QUOTED", "clip", "quote", "quote_all"]

MAX_QUOTED = 64  # characters of one client value
MAX_LISTED = 8  # values of a client list
_INT_BITS = 64  # an integer wider than this is named by its width (repr past 4,300 digits raises)


def quote(value: object, limit: int = MAX_QUOTED) -> str:
    """``repr(value)``, at most ``limit`` characters of a string (its length said where it was
    cut); a list, tuple or set as ``quote_all`` writes it."""
    if type(value) is str and len(value) <= limit:  # the usual case, first
        return repr(value)
    if isinstance(value, str | bytes | bytearray):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}... ({len(value):,} characters)"
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        bits = value.bit_length()
        return repr(value) if bits <= _INT_BITS else f"an integer of {bits:,} bits"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return quote_all(value, limit=limit)
    return clip(repr(value), limit)


def quote_all(
    values: Collection[Any], *, sort: bool = False, most: int = MAX_LISTED, limit: int = MAX_QUOTED
) -> str:
    """``['a', 'b']``: at most ``most`` of ``values`` (the smallest where ``sort``: without
    sorting a long list), each quoted, and how many more there were."""
    shown: Iterable[Any] = heapq.nsmallest(most, values) if sort else _first(values, most)
    listed = ", ".join(quote(v, limit) for v in shown)
    more = len(values) - most
    return f"[{listed}, ... ({more:,} more)]" if more > 0 else f"[{listed}]"


def clip(text: str, limit: int) -> str:
    """``text`` whole, or its first ``limit`` characters and how many it had."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def _first(values: Iterable[Any], most: int) -> list[Any]:
    shown: list[Any] = []
    for value in values:
        if len(shown) == most:
            break
        shown.append(value)
    return shown
