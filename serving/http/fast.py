"""The fast path: POST routes answered by their own handler, without FastAPI's router.

py-spy on ``/predict`` at 64 clients: over half of the server's CPU went to Starlette and
FastAPI layers (exception middleware, routing, dependency solving) around a handler that only
reads the body and awaits the batcher. ``FastPathLayer`` answers the routes of a small registry
before those layers. It is one layer of the middleware stack, inside the middleware a user adds
(``app.add_middleware``: CORS, auth, tracing wrap it like any route) and outside the exception
middleware and the router, which answer every other request as before:

    ServerErrorMiddleware -> FastAPI's own -> user middleware -> FastPathLayer
        -> ExceptionMiddleware -> router

A fast handler maps its own errors to responses; one that escapes is still mapped here (the
exception middleware, which would do it for a routed request, sits below this layer).

When the user added no middleware, ``ShardServeApp`` calls the fast routes itself, before the
stack: nothing would wrap them, and FastAPI's own layers cost a coroutine and a ``send``
wrapper each per request. The predict and infer handlers are raw (``RawHandler``, on
``serving.http.raw``): no Starlette ``Request`` or ``Response`` on their path.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.errors import ShardServeError
from serving.http.replies import (
    REQUEST_ID_HEADER,
    REQUEST_ID_KEY,
    error_response,
    request_id,
    unexpected_response,
)

__all__ = ["FastHandler", "FastPathLayer", "FastRoutes", "RawHandler"]

FastHandler = Callable[[str, str | None, Request], Awaitable[Response]]
"""``async (model name, model version or None, request) -> Response``"""

RawHandler = Callable[[str, str | None, Scope, Receive, Send], Awaitable[None]]
"""``async (model name, model version or None, scope, receive, send)``: answers on ``send``
itself, maps its own errors, and writes the response's ``X-Request-Id``
(``serving.http.raw``)."""

_PARAM = re.compile(r"\{(name|version)\}")
_SEEN_PATHS = 256
_UNSEEN = object()


@dataclass(frozen=True)
class _FastRoute:
    template: str
    pattern: re.Pattern[str]
    handler: RawHandler
    name: str  # the model name of a template without {name}
    exact: bool  # no parameters: compared as a string


class FastRoutes:
    """The POST routes the fast path answers: a path template -> a handler.

    A template may hold ``{name}`` and ``{version}``, each one path segment (no ``/``), as in
    ``/v2/models/{name}/versions/{version}/infer``; a template without ``{name}`` (``/predict``)
    passes the ``name`` it was added with.
    """

    def __init__(self) -> None:
        self._routes: list[_FastRoute] = []
        self._seen: dict[str, tuple[RawHandler, str, str | None] | None] = {}

    def add(self, template: str, handler: FastHandler, *, name: str | None = None) -> None:
        """A route answered by a handler of Starlette requests and responses."""
        self.add_raw(template, _raw(handler), name=name)

    def add_raw(self, template: str, handler: RawHandler, *, name: str | None = None) -> None:
        """A route answered on raw ASGI (the predict and infer routes: no Request, no
        Response objects on their path)."""
        if "{name}" not in template and name is None:
            raise ValueError(f"fast route {template!r} has no {{name}}; pass the model name")
        regex, last = [], 0
        for param in _PARAM.finditer(template):
            regex += [re.escape(template[last : param.start()]), f"(?P<{param[1]}>[^/]+)"]
            last = param.end()
        regex.append(re.escape(template[last:]))
        pattern = re.compile("".join(regex))
        exact = last == 0
        self._routes.append(_FastRoute(template, pattern, handler, name or "", exact))
        self._seen.clear()

    @property
    def templates(self) -> list[str]:
        return [route.template for route in self._routes]

    def match_scope(self, scope: Scope) -> tuple[RawHandler, str, str | None] | None:
        path: str = scope["path"]
        root = scope.get("root_path")
        if root and path.startswith(root):  # the router matches below the root path too
            path = path[len(root) :]
        return self.match(path)

    def match(self, path: str) -> tuple[RawHandler, str, str | None] | None:
        # The paths a server sees repeat (one served model); a regex per request was 3% of
        # the front end's CPU on V2 infer (py-spy). Misses are kept too, a bounded number.
        hit = self._seen.get(path, _UNSEEN)
        if hit is _UNSEEN:
            hit = self._match(path)
            if len(self._seen) >= _SEEN_PATHS:
                self._seen.clear()
            self._seen[path] = hit
        return hit  # type: ignore[return-value]

    def _match(self, path: str) -> tuple[RawHandler, str, str | None] | None:
        for route in self._routes:
            if route.exact:
                if path == route.template:
                    return route.handler, route.name, None
                continue
            found = route.pattern.fullmatch(path)
            if found is not None:
                groups = found.groupdict()
                return route.handler, groups.get("name", route.name), groups.get("version")
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
                handler, name, version = hit
                await handler(name, version, scope, receive, send)
                return
        await self.app(scope, receive, send)


def _raw(handler: FastHandler) -> RawHandler:
    async def answer(
        name: str, version: str | None, scope: Scope, receive: Receive, send: Send
    ) -> None:
        request = Request(scope, receive, send)
        try:
            response = await handler(name, version, request)
        except ShardServeError as exc:
            response = error_response(exc, request_id(request))
        except Exception as exc:
            response = unexpected_response(request, exc)
        rid: bytes | None = scope.get(REQUEST_ID_KEY)
        if rid is not None and REQUEST_ID_HEADER.decode() not in response.headers:
            response.headers[REQUEST_ID_HEADER.decode()] = rid.decode()
        await response(scope, receive, send)

    return answer
