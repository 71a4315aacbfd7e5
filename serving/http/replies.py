"""One set of request and answer helpers for the fast routes (raw ASGI) and the routed ones
(Starlette): request ids, the answer of an error, reading a body, noticing a client that hung up.

An answer is a ``Reply`` tuple; the fast routes send it as two ASGI messages (``send_reply``),
a routed endpoint or exception handler returns it as a Starlette ``Response`` (``as_response``):
the same bytes and headers either way, and one log line per failed request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from serving.errors import PayloadTooLargeError, RequestTimeoutError, ShardServeError
from serving.http.body_deadline import body_deadlines

__all__ = [
    "JSON",
    "OCTET_STREAM",
    "REQUEST_ID_HEADER",
    "REQUEST_ID_KEY",
    "ClientGone",
    "Reply",
    "as_response",
    "error_reply",
    "json_response",
    "log_failure",
    "read_body",
    "request_id",
    "request_id_from",
    "retry_after_seconds",
    "send_reply",
    "send_with_request_id",
    "unexpected_reply",
]

log = logging.getLogger("shardserve")
REQUEST_ID_HEADER = b"x-request-id"
REQUEST_ID_KEY = "shardserve.request_id"  # where the id lives in the ASGI scope
JSON = b"application/json"
OCTET_STREAM = b"application/octet-stream"
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
_ID_PREFIX = os.urandom(8).hex().encode()
_ID_COUNTER = itertools.count()

# (status, body, content type, more headers)
Reply = tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


# ---- request ids


def request_id_from(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The client's ``X-Request-Id`` if it is a safe token (it goes into logs), else a new one."""
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            if _CLIENT_ID.fullmatch(value):
                return value
            break
    # 64 random bits per process and a counter: no getrandom() call per request.
    return b"%s%08x" % (_ID_PREFIX, next(_ID_COUNTER) & 0xFFFFFFFF)


def request_id(scope: Scope) -> bytes:
    """The id ``ShardServeApp`` gave the request (``-`` outside it)."""
    rid: bytes | None = scope.get(REQUEST_ID_KEY)
    return rid if rid is not None else b"-"


def send_with_request_id(send: Send, rid: bytes) -> Send:
    """``send`` that adds the ``X-Request-Id`` header to the response it starts, unless the
    response has one (the fast routes write their own, ``send_reply``)."""
    header = (REQUEST_ID_HEADER, rid)

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            if all(name.lower() != REQUEST_ID_HEADER for name, _ in headers):
                headers.append(header)
            message["headers"] = headers
        await send(message)

    return send_with_id


# ---- answers


def log_failure(rid: str, status: int, message: str) -> None:
    """The one log line of a request that ended in an error, named by its request id.

    503s are load shedding (counted in ``shardserve_rejects_total``): under overload they come
    by the thousand per second, and a line each would spend the core the shedding saves."""
    level = logging.WARNING if status >= 500 else logging.INFO
    if status == 503:
        level = logging.DEBUG
    log.log(level, "request %s: %d %s", rid, status, message)


def retry_after_seconds(exc: ShardServeError) -> int | None:
    """The whole seconds of the error's retry hint (at least 1), or ``None``: the value of
    HTTP's ``Retry-After`` and of gRPC's ``retry-after`` trailing metadata."""
    if exc.retry_after_s is None:
        return None
    return max(1, round(exc.retry_after_s))


def error_reply(exc: ShardServeError, rid: bytes) -> Reply:
    """The answer of a ``ShardServeError``: its status, ``{"error": message}``, ``Retry-After``
    where it has one, ``Connection: close`` where it ends the connection; logged."""
    log_failure(rid.decode(), exc.status_code, exc.message)
    headers = []
    retry_after = retry_after_seconds(exc)
    if retry_after is not None:
        headers.append((b"retry-after", b"%d" % retry_after))
    if exc.closes_connection:
        headers.append((b"connection", b"close"))
    return exc.status_code, orjson.dumps({"error": exc.message}), JSON, headers


def unexpected_reply(scope: Scope, exc: Exception) -> Reply:
    """A 500 that tells the client nothing of the error; the log has it, with the request id."""
    log.error(
        "request %s: 500 unexpected error on %s %s",
        request_id(scope).decode(),
        scope.get("method"),
        scope.get("path"),
        exc_info=exc,
    )
    body = orjson.dumps({"error": "internal server error; see the server log"})
    return 500, body, JSON, []


async def send_reply(
    send: Send,
    rid: bytes,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """The answer as two messages; the ``X-Request-Id`` is written here, so a fast route's
    ``send`` needs no wrapper to add it (``send_with_request_id`` adds none twice)."""
    start = [
        (b"content-type", content_type),
        (b"content-length", b"%d" % len(body)),
        (REQUEST_ID_HEADER, rid),
    ]
    if headers:
        start += headers
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


def as_response(reply: Reply) -> Response:
    """A reply as a Starlette response (a routed endpoint's or an exception handler's)."""
    status, body, content_type, headers = reply
    return Response(
        body,
        status_code=status,
        media_type=content_type.decode("latin-1"),
        headers={k.decode("latin-1"): v.decode("latin-1") for k, v in headers} or None,
    )


def json_response(
    content: Any, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status_code, media_type="application/json", headers=headers)


# ---- bodies


async def read_body(receive: Receive, limit: int, timeout_s: float) -> bytes:
    """The whole body, at most ``limit`` bytes (413 past it) within ``timeout_s`` (408 past
    it, ``serving.http.body_deadline``); ``ClientGone`` on a hang-up.

    In the usual case the body is one message, returned without a copy. A ``Content-Length``
    over the limit is refused before this, from the headers (``serving.http.admission``)."""
    task = asyncio.current_task()
    assert task is not None
    deadlines = body_deadlines()
    deadlines.start(task, timeout_s)
    size = 0
    try:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):
            if len(body) > limit:
                raise PayloadTooLargeError(f"body is over the limit of {limit} bytes")
            return body
        chunks = [body]
        size = len(body)
        while True:
            if size > limit:
                raise PayloadTooLargeError(f"body is over the limit of {limit} bytes")
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False):
                break
    except asyncio.CancelledError:
        if not deadlines.expired(task):
            raise
        task.uncancel()
        raise RequestTimeoutError(
            f"the request body did not arrive within body_read_timeout_s={timeout_s:g} s "
            f"({size} bytes came); send it faster, or raise body_read_timeout_s"
        ) from None
    finally:
        deadlines.end(task)
    if size > limit:
        raise PayloadTooLargeError(f"body is over the limit of {limit} bytes")
    return b"".join(chunks)
