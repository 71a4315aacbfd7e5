"""Admission: what refuses a request from its headers, before its body is read or decoded.

A refused request costs no body read and no decode: under overload that is what keeps the
server from spending its core on bodies it throws away. In order, a predict-like request needs
its model ready (``ModelHandle.require_batcher``), a ``Content-Length`` within
``max_body_bytes`` (413), room in the queue for one more row (503 with ``Retry-After``) and a
well-formed ``X-Request-Timeout-Ms``. uvicorn's protocol (``serving.http.protocol``) refuses a
full queue even earlier, with the same words (``queue_full_message``).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from serving.errors import InvalidInputError, PayloadTooLargeError, QueueFullError
from serving.quoting import clip, quote

if TYPE_CHECKING:
    from serving.batching.batcher import Batcher
    from serving.settings.config import Settings

__all__ = [
    "check_headroom",
    "check_length",
    "declared_length",
    "queue_full_message",
    "request_deadline",
]


# A length of more digits is over any limit: int() is never asked to read it (past 4,300
# digits it raises).
_LENGTH_DIGITS = 18


def declared_length(length: str | bytes | None) -> int | None:
    """A ``Content-Length`` header's value: ``None`` unless it is digits, ``-1`` for more
    digits than any length this server takes (over every limit)."""
    if length is None or not length.isdigit():
        return None
    return int(length) if len(length) <= _LENGTH_DIGITS else -1


def check_length(length: str | bytes | None, limit: int) -> None:
    """413 for a ``Content-Length`` header over ``limit`` (a malformed one is left to the
    body's own limit)."""
    if length is not None and length.isdigit():
        declared = declared_length(length)
        if declared == -1 or (declared is not None and declared > limit):
            shown = length.decode("latin-1") if isinstance(length, bytes) else length
            raise PayloadTooLargeError(
                f"body of {clip(shown, _LENGTH_DIGITS + 2)} bytes is over the limit of "
                f"{limit} bytes"
            )


def queue_full_message(queued: int, limit: int) -> str:
    return f"queue full: {queued} rows queued, max_queue_rows={limit}"


def check_headroom(batcher: Batcher) -> None:
    """Refuse when the queue has no room for even one more row.

    A request that gets past this can still be refused by ``Batcher.submit`` once its row count
    is known."""
    queued, limit = batcher.queued_rows, batcher.settings.max_queue_rows
    if queued >= limit:
        raise QueueFullError(queue_full_message(queued, limit), retry_after_s=1.0)


def request_deadline(header: str | None, settings: Settings) -> float:
    """The request's deadline (``time.monotonic()``): ``request_timeout_ms`` from now, or the
    ``X-Request-Timeout-Ms`` header's if sooner."""
    timeout_ms = settings.request_timeout_ms
    if header is not None:
        try:
            asked = float(header)
        except ValueError:
            asked = float("nan")
        if not 0 < asked < math.inf:  # NaN too
            raise InvalidInputError(
                f"header X-Request-Timeout-Ms must be a positive, finite number of ms, got "
                f"{quote(header)}; leave it out for the server's deadline (request_timeout_ms="
                f"{timeout_ms:g})"
            )
        timeout_ms = min(timeout_ms, asked)
    return time.monotonic() + timeout_ms / 1000.0
