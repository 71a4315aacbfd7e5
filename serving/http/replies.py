"""Request and response plumbing shared by the routes: request ids, JSON replies, error replies,
admission from the headers, the body limit, deadlines, and noticing a client that hung up."""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import Request, Response
from starlette.types import Message, Send

from serving.errors import PayloadTooLargeError, QueueFullError, ShardServeError

if TYPE_CHECKING:
    from serving.batching.batcher import Batcher

log = logging.getLogger("shardserve")
REQUEST_ID_HEADER = b"x-request-id"
REQUEST_ID_KEY = "shardserve.request_id"  # where the id lives in the ASGI scope
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
_ID_PREFIX = os.urandom(8).hex().encode()
_ID_COUNTER = itertools.count()


def request_id_from(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The client's ``X-Request-Id`` if it is a safe token (it goes into logs), else a new one."""
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            if _CLIENT_ID.fullmatch(value):
                return value
            break
    # 64 random bits per process and a counter: no getrandom() call per request.
    return b"%s%08x" % (_ID_PREFIX, next(_ID_COUNTER) & 0xFFFFFFFF)


def request_id(request: Request) -> str:
    rid: bytes | None = request.scope.get(REQUEST_ID_KEY)
    return rid.decode() if rid is not None else "-"


def send_with_request_id(send: Send, rid: bytes) -> Send:
    """``send`` that adds the ``X-Request-Id`` header to the response it starts, unless the
    response has one (the fast routes write their own, ``serving.http.raw.send_reply``)."""
    header = (REQUEST_ID_HEADER, rid)

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            if all(name.lower() != REQUEST_ID_HEADER for name, _ in headers):
                headers.append(header)
            message["headers"] = headers
        await send(message)

    return send_with_id


def log_failure(rid: str, status: int, message: str) -> None:
    """The one log line of a request that ended in an error, named by its request id.

    503s are load shedding (counted in ``shardserve_rejects_total``): under overload they come
    by the thousand per second, and a line each would spend the core the shedding saves."""
    level = logging.WARNING if status >= 500 else logging.INFO
    if status == 503:
        level = logging.DEBUG
    log.log(level, "request %s: %d %s", rid, status, message)


def json_response(
    content: Any, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status_code, media_type="application/json", headers=headers)


def error_response(exc: ShardServeError, rid: str = "-") -> Response:
    log_failure(rid, exc.status_code, exc.message)
    headers = None
    if exc.retry_after_s is not None:
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    return json_response({"error": exc.message}, exc.status_code, headers)


def unexpected_response(request: Request, exc: Exception) -> Response:
    log.error(
        "request %s: 500 unexpected error on %s %s",
        request_id(request),
        request.method,
        request.url.path,
        exc_info=exc,
    )
    return json_response({"error": "internal server error; see the server log"}, 500)


def check_content_length(request: Request, limit: int) -> None:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLargeError(f"body of {length} bytes is over the limit of {limit} bytes")


def check_headroom(batcher: Batcher) -> None:
    """Refuse before the body is read when the queue has no room for even one more row.

    A request that gets past this can still be refused by ``Batcher.submit`` once its row count
    is known; this check is what keeps an overloaded server from decoding bodies it throws away.
    """
    queued, limit = batcher.queued_rows, batcher.policy.max_queue_rows
    if queued >= limit:
        raise QueueFullError(
            f"queue full: {queued} rows queued, max_queue_rows={limit}", retry_after_s=1.0
        )


async def read_body(request: Request, limit: int) -> bytes:
    check_content_length(request, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""
