"""The fast routes: POST routes answered on raw ASGI by their own handler, before FastAPI's
router, and the request they read.

py-spy on ``/predict`` at 64 clients: over half of the server's CPU went to Starlette and
FastAPI layers (exception middleware, routing, dependency solving) around a handler that only
reads the body and awaits the batcher. ``FastPathLayer`` answers the routes of a small registry
(``FastRoutes``) before those layers. It is one layer of the middleware stack, inside the
middleware a user adds (``app.add_middleware``: CORS, auth, tracing wrap it like any route) and
outside the exception middleware and the router, which answer every other request as before:

    ServerErrorMiddleware -> FastAPI's own -> user middleware -> FastPathLayer
        -> ExceptionMiddleware -> router

A fast handler maps its own errors to answers. When the user added no middleware,
``ShardServeApp`` calls the fast routes itself, before the stack: nothing would wrap them, and
FastAPI's own layers cost a coroutine and a ``send`` wrapper each per request.

The predict and infer handlers (``RawHandler``) see no Starlette ``Request`` or ``Response``:
``FastRequest`` picks the headers they read from the scope in one pass and reads the body
straight from ``receive``; the answer goes out as two ASGI messages
(``serving.http.replies.send_reply``). py-spy on V2 binary infer of the light model (64
clients): Starlette's ``Headers`` lookups (four per request, each a scan that decodes every
header), its ``Request``, ``Response`` and ``send`` wrappers took about a fifth of the front
end's CPU (docs/benchmarks.md, issue 11).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.errors import ShardServeError
from serving.http.admission import declared_length
from serving.http.replies import (
    REQUEST_ID_HEADER,
    REQUEST_ID_KEY,
    Body,
    ClientGone,
    as_response,
    error_reply,
    read_body,
    request_id,
    request_id_from,
    unexpected_reply,
)

__all__ = [
    "DISCONNECT_KEY",
    "FastHandler",
    "FastPathLayer",
    "FastRequest",
    "FastRoutes",
    "HeaderRefusal",
    "ModelRef",
    "RawAnswer",
    "RawHandler",
]


@dataclass(frozen=True, slots=True)
class ModelRef:
    """The model a request's path names: ``name`` (``None``: the default model, as for
    ``/predict``), and at most one of ``version`` and ``label`` (``None``: the model's
    default version). Made once per path (``FastRoutes`` keeps the paths it has seen)."""

    name: str | None
    version: str | None = None
    label: str | None = None


FastHandler = Callable[[ModelRef, Request], Awaitable[Response]]
"""``async (the model the path names, request) -> Response``"""

RawHandler = Callable[[ModelRef, Scope, Receive, Send], Awaitable[None]]
"""``async (the model the path names, scope, receive, send)``: answers on ``send`` itself, maps
its own errors, and writes the response's ``X-Request-Id``."""

# The scope key of a list of callbacks the server calls when the client hangs up before the
# answer is complete (set by serving.http.protocol; absent under another server).
DISCONNECT_KEY = "shardserve.on_disconnect"
T = TypeVar("T")
_PARAM = re.compile(r"\{(name|version|label)\}")
_SEEN_PATHS = 256
_UNSEEN = object()


@dataclass(frozen=True)
class _FastRoute:
    template: str
    pattern: re.Pattern[str]
    handler: RawHandler
    name: str | None  # the model of a template without {name} (None: the default model)
    exact: bool  # no parameters: compared as a string


Hit = tuple[RawHandler, ModelRef]
# (the app's model directory, the route's model, the request's scope, its time.perf_counter()) ->
# (its request id, the 503's JSON body, its total ms) where its model's queue is full and the
# refusal is counted, else None: the data plane's refusal from the headers, which uvicorn's
# protocol answers (``serving.http.protocol``).
HeaderRefusal = Callable[[Any, ModelRef, Scope, float], "tuple[bytes, bytes, float] | None"]


class FastRoutes:
    """The POST routes the fast path answers: a path template -> a handler.

    A template may hold ``{name}`` and one of ``{version}`` and ``{label}``, each one path
    segment (no ``/``), as in ``/v2/models/{name}/versions/{version}/infer``; a template without
    ``{name}`` (``/predict``) names the model it was added with, by default the server's default
    model.
    """

    def __init__(self) -> None:
        self._routes: list[_FastRoute] = []
        self._seen: dict[str, Hit | None] = {}
        # Set by the server: ``serving.protocols.rest.refuse_from_headers``; None: no refusal
        # from the headers (every request goes to the app).
        self.refuse_from_headers: HeaderRefusal | None = None

    def add(self, template: str, handler: FastHandler, *, name: str | None = None) -> None:
        """A route answered by a handler of Starlette requests and responses."""
        self.add_raw(template, _raw(handler), name=name)

    def add_raw(self, template: str, handler: RawHandler, *, name: str | None = None) -> None:
        """A route answered on raw ASGI (the predict and infer routes: no Request, no
        Response objects on their path)."""
        if "{version}" in template and "{label}" in template:
            raise ValueError(f"fast route {template!r} names both a version and a label")
        regex, last = [], 0
        for param in _PARAM.finditer(template):
            regex += [re.escape(template[last : param.start()]), f"(?P<{param[1]}>[^/]+)"]
            last = param.end()
        regex.append(re.escape(template[last:]))
        pattern = re.compile("".join(regex))
        exact = last == 0
        self._routes.append(_FastRoute(template, pattern, handler, name, exact))
        self._seen.clear()

    @property
    def templates(self) -> list[str]:
        return [route.template for route in self._routes]

    def match_scope(self, scope: Scope) -> Hit | None:
        path: str = scope["path"]
        root = scope.get("root_path")
        if root and path.startswith(root):  # the router matches below the root path too
            path = path[len(root) :]
        return self.match(path)

    def match(self, path: str) -> Hit | None:
        # The paths a server sees repeat (a few models and versions); a regex per request was
        # 3% of the front end's CPU on V2 infer (py-spy). Misses are kept too, a bounded number.
        hit = self._seen.get(path, _UNSEEN)
        if hit is _UNSEEN:
            hit = self._match(path)
            if len(self._seen) >= _SEEN_PATHS:
                self._seen.clear()
            self._seen[path] = hit
        return hit  # type: ignore[return-value]

    def _match(self, path: str) -> Hit | None:
        for route in self._routes:
            if route.exact:
                if path == route.template:
                    return route.handler, ModelRef(route.name)
                continue
            found = route.pattern.fullmatch(path)
            if found is not None:
                groups = found.groupdict()
                ref = ModelRef(
                    groups.get("name", route.name), groups.get("version"), groups.get("label")
                )
                return route.handler, ref
        return None


class FastPathLayer:
    """ASGI middleware: a POST to a route of ``routes`` is answered here, the rest passes on."""

    def __init__(self, app: ASGIApp, routes: FastRoutes) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            hit = self.routes.match_scope(scope)
            if hit is not None:
                handler, ref = hit
                await handler(ref, scope, receive, send)
                return
        await self.app(scope, receive, send)


def _raw(handler: FastHandler) -> RawHandler:
    async def answer(ref: ModelRef, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await handler(ref, request)
        except ShardServeError as exc:
            response = as_response(error_reply(exc, request_id(scope)))
        except Exception as exc:
            response = as_response(unexpected_reply(scope, exc))
        rid: bytes | None = scope.get(REQUEST_ID_KEY)
        if rid is not None and REQUEST_ID_HEADER.decode() not in response.headers:
            response.headers[REQUEST_ID_HEADER.decode()] = rid.decode()
        await response(scope, receive, send)

    return answer


class FastRequest:
    """One request of a fast route: its ASGI triple and the headers the routes read.

    Header values are ``str`` (latin-1, as Starlette decodes them); the first of a repeated
    header wins, as with ``Headers.get``.
    """

    __slots__ = (
        "content_encoding",
        "content_length",
        "header_length",
        "priority",
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
        length = timeout = header_length = encoding = priority = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = length or value
            elif name == b"x-request-timeout-ms":
                timeout = timeout or value
            elif name == b"inference-header-content-length":
                header_length = header_length or value
            elif name == b"content-encoding":
                encoding = encoding or value
            elif name == b"x-priority":
                priority = priority or value
        self.content_length = None if length is None else length.decode("latin-1")
        self.timeout_ms = None if timeout is None else timeout.decode("latin-1")
        self.header_length = None if header_length is None else header_length.decode("latin-1")
        self.content_encoding = None if encoding is None else encoding.decode("latin-1")
        # A generate request's level (``serving.generation.levels``), where its body names none.
        self.priority = None if priority is None else priority.decode("latin-1")

    @property
    def request_id(self) -> str:
        return self.rid.decode()

    async def body(self, limit: int, timeout_s: float) -> Body:
        """The whole body, at most ``limit`` bytes (413 past it) within ``timeout_s`` (408
        past it); ``ClientGone`` on a hang-up."""
        length = self.content_length
        declared = declared_length(length)
        return await read_body(self.receive, limit, timeout_s, declared)

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
            # Not supervised: it lives and dies with this request (cancelled in ``finally``).
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


class RawAnswer(Response):
    """A routed endpoint's answer given by a raw fast handler: the router's predict and infer
    routes, reached when the fast path does not answer first (a plain FastAPI app given these
    routes)."""

    def __init__(self, handler: RawHandler, ref: ModelRef) -> None:
        super().__init__()
        self.handler = handler
        self.ref = ref

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(self.ref, scope, receive, send)
