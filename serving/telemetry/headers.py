"""What the telemetry reads of an HTTP request and writes on its answer: the W3C trace context
headers, the client's address, the ``Server-Timing`` header (plain ASGI, no Starlette)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["SERVER_TIMING", "client_address", "server_timing_of", "trace_headers"]

SERVER_TIMING = b"server-timing"


def trace_headers(headers: Iterable[tuple[bytes, bytes]]) -> tuple[str | None, str | None]:
    """The request's ``traceparent`` and ``tracestate`` (the first of each)."""
    parent = state = None
    for name, value in headers:
        if name == b"traceparent" and parent is None:
            parent = value.decode("latin-1")
        elif name == b"tracestate" and state is None:
            state = value.decode("latin-1")
    return parent, state


def client_address(scope: Mapping[str, Any]) -> str:
    """``host:port`` of the peer, ``-`` where the server does not know it."""
    client = scope.get("client")
    if not client:
        return "-"
    return f"{client[0]}:{client[1]}"


def server_timing_of(total_ms: float) -> bytes:
    """``Server-Timing`` of an answer given before any queue or compute (a refusal)."""
    return b"queue;dur=0.000, compute;dur=0.000, total;dur=%.3f" % total_ms
