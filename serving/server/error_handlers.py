"""The one mapping from exceptions to HTTP answers for the routed (non-fast) path: a
``ShardServeError`` is its own status and message, an HTTP error of Starlette's keeps its status
(a 405 names every method of the path), anything else is a 500 that names no internals."""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from serving.errors import ShardServeError
from serving.http.replies import (
    as_response,
    error_reply,
    json_response,
    log_failure,
    request_id,
    unexpected_reply,
)

__all__ = ["install_error_handlers"]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ShardServeError)
    async def _shardserve_error(request: Request, exc: ShardServeError) -> Response:
        return as_response(error_reply(exc, request_id(request.scope)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        log_failure(request_id(request.scope).decode(), exc.status_code, str(exc.detail))
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(request))
        return json_response({"error": str(exc.detail)}, exc.status_code, headers or None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return as_response(unexpected_reply(request.scope, exc))


def _allowed_methods(request: Request) -> list[str]:
    """The methods of every route on the request's path (the router's 405 names only those of
    the first route it tried, and a path may have one route per method)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] is not Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)
