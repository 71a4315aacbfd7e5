"""Request and response plumbing shared by the routes: JSON replies, error replies, the body
limit, deadlines, and noticing a client that hung up."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

import orjson
from fastapi import Request, Response

from serving.config import Settings
from serving.errors import InvalidInputError, PayloadTooLargeError, QueueFullError, ShardServeError

log = logging.getLogger("shardserve")
TIMEOUT_HEADER = "x-request-timeout-ms"


def json_response(
    content: Any, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status_code, media_type="application/json", headers=headers)


def error_response(exc: ShardServeError) -> Response:
    headers = None
    if isinstance(exc, QueueFullError):
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    return json_response({"error": exc.message}, exc.status_code, headers)


def unexpected_response(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return json_response({"error": "internal server error; see the server log"}, 500)


async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLargeError(f"body of {length} bytes is over the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def request_deadline(request: Request, settings: Settings) -> float:
    timeout_ms = settings.request_timeout_ms
    header = request.headers.get(TIMEOUT_HEADER)
    if header is not None:
        try:
            asked = float(header)
        except ValueError:
            asked = float("nan")
        if not asked > 0:
            raise InvalidInputError(
                f"header X-Request-Timeout-Ms must be a positive number of ms, got {header!r}"
            )
        timeout_ms = min(timeout_ms, asked)
    return time.monotonic() + timeout_ms / 1000.0


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client goes away first, cancel it (its rows are then dropped)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    # A done-callback instead of asyncio.wait: no per-request set of waiters (measured on the
    # hot path); cancelling a finished task is a no-op.
    watcher.add_done_callback(lambda _: task.cancel())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientGone from None
        raise
    finally:
        watcher.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
