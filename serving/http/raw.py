"""The fast routes' HTTP plumbing on raw ASGI: no Starlette ``Request`` or ``Response``.

The headers a predict-like route reads are picked from the scope in one pass, the body is read
straight from ``receive`` (one message, no copy, in the usual case), and the answer goes out as
two ASGI messages with a short list of headers. py-spy on V2 binary infer of the light model
(64 clients): Starlette's ``Headers`` lookups (four per request, each a scan that decodes every
header), its ``Request``, ``Response`` and ``send`` wrappers took about a fifth of the front
end's CPU (docs/benchmarks.md, issue 11).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from serving.errors import PayloadTooLargeError, ShardServeError
from serving.http.replies import (
    REQUEST_ID_HEADER,
    REQUEST_ID_KEY,
    ClientGone,
    log_failure,
    request_id_from,
)

__all__ = [
    "JSON",
    "OCTET_STREAM",
    "FastRequest",
    "RawAnswer",
    "Reply",
    "error_reply",
    "send_reply",
    "unexpected_reply",
]

log = logging.getLogger("shardserve")
# The scope key of a list of callbacks the server calls when the client hangs up before the
# answer is complete (set by serving.http.protocol; absent under another server).
DISCONNECT_KEY = "shardserve.on_disconnect"
T = TypeVar("T")
JSON = b"application/json"
OCTET_STREAM = b"application/octet-stream"

# (status, body, content type, more headers)
Reply = tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]


class FastRequest:
    """One request of a fast route: its ASGI triple and the headers the routes read.

    Header values are ``str`` (latin-1, as Starlette decodes them); the first of a repeated
    header wins, as with ``Headers.get``.
    """

    __slots__ = (
        "content_encoding",
        "content_length",
        "header_length",
        "receive",
        "rid",
        "scope",
        "send",
        "timeout_ms",
    )

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        rid: bytes | None = scope.get(REQUEST_ID_KEY)
        if rid is None:
            rid = scope[REQUEST_ID_KEY] = request_id_from(scope["headers"])
        self.rid = rid
        length = timeout = header_length = encoding = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = length or value
            elif name == b"x-request-timeout-ms":
                timeout = timeout or value
            elif name == b"inference-header-content-length":
                header_length = header_length or value
            elif name == b"content-encoding":
                encoding = encoding or value
        self.content_length = None if length is None else length.decode("latin-1")
        self.timeout_ms = None if timeout is None else timeout.decode("latin-1")
        self.header_length = None if header_length is None else header_length.decode("latin-1")
        self.content_encoding = None if encoding is None else encoding.decode("latin-1")

    @property
    def request_id(self) -> str:
        return self.rid.decode()

    async def body(self, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes (413 past it); ``ClientGone`` on a hang-up."""
        message = await self.receive()
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
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False):
                break
        if size > limit:
            raise PayloadTooLargeError(f"body is over the limit of {limit} bytes")
        return b"".join(chunks)

    async def until_disconnect(self, work: Awaitable[T]) -> T:
        """Await ``work``; if the client goes away first, cancel it (its rows are then dropped).

        ``work`` runs in this task, which a hang-up cancels: told by the server's protocol
        (``DISCONNECT_KEY``), or else by a watcher task blocked in ``receive()``."""
        task = asyncio.current_task()
        assert task is not None
        state = [False, False]  # [the client went away, the work is over]

        def gone(*_: object) -> None:
            if not state[1]:
                state[0] = True
                task.cancel()

        hooks: list[Callable[[], None]] | None = self.scope.get(DISCONNECT_KEY)
        watcher = None
        if hooks is not None:  # shardserve's protocol calls it (serving.http.protocol)
            hooks.append(gone)
        else:
            watcher = asyncio.ensure_future(self._wait_disconnect())
            watcher.add_done_callback(lambda w: None if w.cancelled() else gone())
        try:
            return await work
        except asyncio.CancelledError:
            if state[0]:
                task.uncancel()
                raise ClientGone from None
            raise
        finally:
            state[1] = True
            if watcher is not None:
                watcher.cancel()

    async def _wait_disconnect(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return


async def send_reply(
    send: Send,
    rid: bytes,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """The answer as two messages; the ``X-Request-Id`` is written here, so a fast route's
    ``send`` needs no wrapper to add it (``http_io.send_with_request_id`` adds none twice)."""
    start = [
        (b"content-type", content_type),
        (b"content-length", b"%d" % len(body)),
        (REQUEST_ID_HEADER, rid),
    ]
    if headers:
        start += headers
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


def error_reply(exc: ShardServeError, rid: bytes) -> Reply:
    """``http_io.error_response``'s answer, logged the same way."""
    log_failure(rid.decode(), exc.status_code, exc.message)
    headers = []
    if exc.retry_after_s is not None:
        headers.append((b"retry-after", b"%d" % max(1, round(exc.retry_after_s))))
    return exc.status_code, orjson.dumps({"error": exc.message}), JSON, headers


def unexpected_reply(request: FastRequest, exc: Exception) -> Reply:
    scope = request.scope
    log.error(
        "request %s: 500 unexpected error on %s %s",
        request.request_id,
        scope.get("method"),
        scope.get("path"),
        exc_info=exc,
    )
    body = orjson.dumps({"error": "internal server error; see the server log"})
    return 500, body, JSON, []


class RawAnswer(Response):
    """A routed endpoint's answer given by a raw fast handler
    (``serving.http.fastpath.RawHandler``):
    the router's predict and infer routes, reached when the fast path does not answer first
    (a plain FastAPI app given these routes)."""

    def __init__(self, handler: Any, name: str, version: str | None) -> None:
        super().__init__()
        self.handler = handler
        self.name = name
        self.version = version

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(self.name, self.version, scope, receive, send)
