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
import time
from collections.abc import Iterable
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from serving.batching.dispatch import SHUTTING_DOWN
from serving.errors import (
    BodyCutError,
    PayloadTooLargeError,
    RequestTimeoutError,
    ShardServeError,
)
from serving.http.body_deadline import body_deadlines
from serving.quoting import clip

__all__ = [
    "JSON",
    "OCTET_STREAM",
    "REQUEST_ID_HEADER",
    "REQUEST_ID_KEY",
    "Body",
    "ClientGone",
    "FailureLines",
    "Reply",
    "as_response",
    "error_reply",
    "failure_lines",
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


# A flood of failures (a client sending the same bad request in a loop) is summarised: per
# status, the first _LINES_PER_INTERVAL lines of each interval are written, the rest counted
# and said in one line when the interval ends.
_INTERVAL_S = 10.0
_LINES_PER_INTERVAL = 20
_LOGGED_CHARACTERS = 1000  # of an error's message: its client data is cut already (quoting)


class FailureLines:
    """How many failure lines each status wrote this interval, and how many it left out."""

    def __init__(self) -> None:
        self.ends = 0.0
        self.written: dict[int, int] = {}
        self.left_out: dict[int, int] = {}

    def reset(self) -> None:
        """A new interval, with nothing counted (what each test starts from)."""
        self.ends = 0.0
        self.written.clear()
        self.left_out.clear()

    def admit(self, status: int) -> bool:
        now = time.monotonic()
        if now >= self.ends:
            self.flush()
            self.ends = now + _INTERVAL_S
        written = self.written.get(status, 0)
        if written < _LINES_PER_INTERVAL:
            self.written[status] = written + 1
            return True
        if not self.left_out:
            self._flush_later()
        self.left_out[status] = self.left_out.get(status, 0) + 1
        return False

    def flush(self) -> None:
        for status, count in sorted(self.left_out.items()):
            level = logging.WARNING if status >= 500 else logging.INFO
            log.log(
                level,
                "%d more requests ended %d in the last %g s (each line past %d left out)",
                count,
                status,
                _INTERVAL_S,
                _LINES_PER_INTERVAL,
            )
        self.written.clear()
        self.left_out.clear()

    def _flush_later(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: the next failure after the interval says it
            return
        loop.call_at(loop.time() + max(0.0, self.ends - time.monotonic()), self._end)

    def _end(self) -> None:
        if self.left_out and time.monotonic() >= self.ends:
            self.flush()


failure_lines = FailureLines()


def log_failure(rid: str, status: int, message: str) -> None:
    """The one log line of a request that ended in an error, named by its request id; under a
    flood, per status at most ``_LINES_PER_INTERVAL`` an interval, then a count.

    503s are load shedding (counted in ``shardserve_rejects_total``): under overload they come
    by the thousand per second, and a line each would spend the core the shedding saves."""
    level = logging.WARNING if status >= 500 else logging.INFO
    if status == 503:
        level = logging.DEBUG
    if not log.isEnabledFor(level) or not failure_lines.admit(status):
        return
    log.log(level, "request %s: %d %s", rid, status, clip(message, _LOGGED_CHARACTERS))


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
        clip(scope.get("path") or "", _LOGGED_CHARACTERS),
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

# A body whose length is declared is read into one buffer of that length, allocated once an
# eighth of it has come (the chunks before are then copied in and dropped): the body is held
# once, not as chunks and then their join (a 16 MiB body took 32 MiB more than itself), and a
# client that declares 16 MiB and trickles a few bytes holds no 16 MiB for it: at most 8 times
# what it sent, within body_read_timeout_s.
_ALLOCATE_AFTER = 8

Body = bytes | bytearray  # what read_body gives: parsed as it is by orjson and numpy


class _Buffer:
    """A body's bytes as they come, each held once (at most ``limit`` of them)."""

    __slots__ = ("chunks", "declared", "limit", "size", "whole")

    def __init__(self, limit: int, declared: int | None) -> None:
        self.limit = limit
        # A Content-Length over the limit is refused before the read (serving.http.admission).
        self.declared = declared if declared is not None and 0 <= declared <= limit else None
        self.chunks: list[bytes] = []
        # Without a declared length (chunked), grown in place: realloc moves a large buffer
        # without a copy (mremap) where it can.
        self.whole: bytearray | None = bytearray() if self.declared is None else None
        self.size = 0

    def add(self, chunk: bytes) -> None:
        start, end = self.size, self.size + len(chunk)
        if end > self.limit:
            raise PayloadTooLargeError(f"body is over the limit of {self.limit} bytes")
        self.size = end
        whole = self.whole
        if whole is not None:
            whole[start:end] = chunk  # past a declared length (never, framed by it): grows
            return
        self.chunks.append(chunk)
        assert self.declared is not None
        if end * _ALLOCATE_AFTER >= self.declared:
            whole = self.whole = bytearray(self.declared)
            at = 0
            for held in self.chunks:
                whole[at : at + len(held)] = held
                at += len(held)
            self.chunks.clear()

    def body(self) -> Body:
        whole = self.whole
        if whole is None:  # short of an eighth of what it declared: the server ended it early
            return b"".join(self.chunks)
        if len(whole) > self.size:
            del whole[self.size :]
        return whole


async def read_body(
    receive: Receive, limit: int, timeout_s: float, length: int | None = None
) -> Body:
    """The whole body, at most ``limit`` bytes (413 past it) within ``timeout_s`` (408 past
    it, ``serving.http.body_deadline``; 503 where the server's stop cuts it); ``ClientGone``
    on a hang-up. ``length``: the ``Content-Length``, if any.

    In the usual case the body is one message, returned without a copy; else its messages go
    into one ``bytearray`` (``_Buffer``). A ``Content-Length`` over the limit is refused before
    this, from the headers (``serving.http.admission``)."""
    task = asyncio.current_task()
    assert task is not None
    deadlines = body_deadlines()
    deadlines.start(task, timeout_s)
    buffer: _Buffer | None = None
    try:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):
            if len(body) > limit:
                raise PayloadTooLargeError(f"body is over the limit of {limit} bytes")
            return body
        buffer = _Buffer(limit, length)
        buffer.add(body)
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            buffer.add(message.get("body", b""))
            if not message.get("more_body", False):
                return buffer.body()
    except asyncio.CancelledError:
        size = 0 if buffer is None else buffer.size
        buffer = None  # the bytes are dropped before the answer
        if deadlines.expired(task):
            task.uncancel()
            raise RequestTimeoutError(
                f"the request body did not arrive within body_read_timeout_s={timeout_s:g} s "
                f"({size} bytes came); send it faster, or raise body_read_timeout_s"
            ) from None
        if deadlines.cut(task):
            task.uncancel()
            raise BodyCutError(
                f"{SHUTTING_DOWN}: the request body was still arriving at the end of its drain "
                f"({size} bytes came); send the request again"
            ) from None
        raise
    finally:
        deadlines.end(task)
