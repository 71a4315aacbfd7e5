"""The HTTP API: routes, the lifespan that owns every resource, and the error-to-status map."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.batching.batcher import Batcher
from serving.config import Settings
from serving.errors import (
    NotFoundError,
    NotReadyError,
    ShardServeError,
)
from serving.http.fastpath import FastPathLayer, FastRoutes, RawHandler
from serving.http.raw import JSON, FastRequest, RawAnswer, Reply, error_reply, send_reply
from serving.http.replies import (
    REQUEST_ID_KEY,
    error_response,
    json_response,
    log_failure,
    request_id,
    request_id_from,
    send_with_request_id,
    unexpected_response,
)
from serving.openapi.document import (
    PREDICT_REQUEST,
    PREDICT_RESPONSE,
    Alive,
    ModelMetadata,
    ModelStatus,
    Readiness,
    document,
    errors,
    ok,
)
from serving.protocols.tfserving.codec import decode_predict, encode_predict
from serving.protocols.tfserving.predict import serve_prediction
from serving.protocols.v2.grpc_server import start_grpc_server, stop_grpc_server
from serving.protocols.v2.http import install_v2_routes, v2_infer
from serving.server.admin import install_admin_routes
from serving.server.lifespan import load_model, poll_stage_stats
from serving.server.runner import ModelRunner, build_runner
from serving.server.state import RunnerFactory, ServerState
from serving.server.stop_budget import drain_batcher

if TYPE_CHECKING:
    import grpc

log = logging.getLogger("shardserve")


def create_app(
    settings: Settings,
    runner_factory: RunnerFactory = build_runner,
    *,
    on_load_failure: Callable[[str], None] | None = None,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = ServerState(settings=settings)
        app.state.shardserve = state
        grpc_server = await start_grpc_server(state)  # None when grpc_port is 0
        # Load in the background so /healthz and /readyz answer while the model loads.
        loader = asyncio.create_task(load_model(state, runner_factory, on_load_failure))
        poller = asyncio.create_task(poll_stage_stats(state))
        try:
            yield
        finally:
            await _shut_down(state, grpc_server, loader, poller)

    app = ShardServeApp(title="shardserve", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.served_name = settings.served_name()
    _install_error_handlers(app)
    _install_routes(app, settings)
    install_admin_routes(app, settings)
    install_v2_routes(app, settings)
    return app


async def _shut_down(
    state: ServerState,
    grpc_server: grpc.aio.Server | None,
    loader: asyncio.Task[None],
    poller: asyncio.Task[None],
) -> None:
    """Every step within what is left of the stop budget (``serving.server.stop_budget``): after a
    SIGTERM the graceful server has drained the batcher already, out of the same budget."""
    budget = state.begin_stop()
    poller.cancel()
    loader.cancel()
    await asyncio.wait([loader, poller], timeout=budget.answer_left())
    if state.batcher is not None:
        # gRPC keeps serving meanwhile: its calls held in the batcher get their answers.
        await drain_batcher(state.batcher, budget)
    await stop_grpc_server(grpc_server, grace_s=budget.answer_left())
    if state.runner is not None:
        try:
            await asyncio.wait_for(state.runner.close(), budget.left())
        except Exception:  # a dead Ray must not keep the process from exiting
            log.warning("closing the model runner failed", exc_info=True)


class ShardServeApp(FastAPI):
    """FastAPI with the fast path (``serving.http.fastpath``) for the predict and infer routes, an
    ``X-Request-Id`` on every response, and an OpenAPI document that follows the served model.

    ``fast_routes`` holds the routes the fast path answers; they are declared on the router too,
    for the OpenAPI document.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_routes = FastRoutes()
        self.served_name = ""
        self._doc_key: tuple[object, ...] | None = None
        self._doc: dict[str, Any] = {}
        self._untraced: bool | None = None
        self._bare = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        rid = request_id_from(scope["headers"])
        scope[REQUEST_ID_KEY] = rid
        if self._untraced is None:
            self._untraced = _untraced(self)
        if self._bare and self._untraced and scope["method"] == "POST":
            # No middleware of the user's, no body limit of FastAPI's: the fast routes are
            # answered here, before the five layers FastAPI's stack would pass them through
            # (each one a coroutine and a ``send`` wrapper per request). Their handlers write
            # the request id and map every error themselves.
            hit = self.fast_routes.match_scope(scope)
            if hit is not None:
                handler, name, version = hit
                scope["app"] = self
                await handler(name, version, scope, receive, send)
                return
        # Outside every middleware, so that their own answers (a CORS preflight, a 500 from
        # ServerErrorMiddleware) carry the id too.
        send = send_with_request_id(send, rid)
        if self._untraced and self.middleware_stack is not None:
            # FastAPI.__call__ asks OpenTelemetry on every request whether it is configured
            # (8 us, as much as the rest of the stack); the answer is taken once, at the first
            # request: telemetry configured later than that is not seen.
            scope["app"] = self
            await self.middleware_stack(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    @property
    def answers_fast_routes(self) -> bool:
        """The fast routes are answered before the middleware stack, which nothing of the
        user's joined (known from the first request on; ``serving.http.protocol`` asks)."""
        return self._bare and bool(self._untraced)

    def build_middleware_stack(self) -> ASGIApp:
        # Nothing of the user's (or FastAPI's body limit) would wrap a fast route. Starlette
        # builds the stack once, at the first request, and refuses middleware after that.
        self._bare = not self.user_middleware and getattr(self, "max_body_size", None) is None
        # The fast path joins the stack as the innermost user middleware: below everything
        # added with add_middleware, above the exception middleware and the router.
        user = self.user_middleware
        self.user_middleware = [*user, Middleware(FastPathLayer, routes=self.fast_routes)]
        try:
            return super().build_middleware_stack()
        finally:
            self.user_middleware = user

    def openapi(self) -> dict[str, Any]:
        # Built once per model, not per request nor per batching policy (an admin PUT changes
        # that): the rows a request may hold are the start-up queue's, which a PUT keeps.
        state: ServerState | None = getattr(self.state, "shardserve", None)
        runner = state.runner if state is not None else None
        signature = runner.signature if runner is not None else None
        max_rows = None
        if state is not None and runner is not None:
            max_rows = state.settings.queue_rows(runner.num_stages, runner.replicas)
        key = (signature, max_rows)
        if key != self._doc_key:
            base = super().openapi()
            self._doc = document(base, signature, self.served_name, max_rows)
            self._doc_key = key
        return self._doc


def _untraced(app: FastAPI) -> bool:
    """No root path to set and FastAPI's native telemetry off (unknown: assume on)."""
    telemetry = getattr(app, "_native_telemetry", None)
    enabled = getattr(telemetry, "enabled", None)
    return not app.root_path and callable(enabled) and not enabled()


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.shardserve
    return state


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ShardServeError)
    async def _shardserve_error(request: Request, exc: ShardServeError) -> Response:
        return error_response(exc, request_id(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        log_failure(request_id(request), exc.status_code, str(exc.detail))
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(request))
        return json_response({"error": str(exc.detail)}, exc.status_code, headers or None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return unexpected_response(request, exc)


class _StatusName(Convertor[str]):
    """The {name} of GET /v1/models/{name}: not one that ends in ``:predict``, which is the
    POST route's (so that its 405 names only POST)."""

    regex = r"[^/]+(?<!:predict)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("model_status", _StatusName())


def _allowed_methods(request: Request) -> list[str]:
    """The methods of every route on the request's path (the router's 405 names only those of
    the first route it tried, and a path may have one route per method)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] is not Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


def _install_routes(app: FastAPI, settings: Settings) -> None:
    served = settings.served_name()

    def check_name(name: str) -> None:
        if name != served:
            raise NotFoundError(f"model {name!r} not found; this server serves {served!r}")

    async def predict_work(
        request: FastRequest, batcher: Batcher, runner: ModelRunner, deadline: float, rid: str
    ) -> Reply:
        body = await request.body(settings.max_body_bytes)
        # Inline, not on a thread: orjson and numpy hold the GIL while they parse, so a thread
        # stalled the loop as long and took no less time (bench looplag, docs/benchmarks.md).
        decoded = decode_predict(body, runner.signature)
        outputs = await request.until_disconnect(
            batcher.submit(decoded.inputs, deadline=deadline, request_id=rid)
        )
        return 200, encode_predict(outputs, runner.signature, decoded.form), JSON, []

    async def predict_model(
        name: str, version: str | None, scope: Scope, receive: Receive, send: Send
    ) -> None:
        request = FastRequest(scope, receive, send)
        if name != served:
            exc = NotFoundError(f"model {name!r} not found; this server serves {served!r}")
            await send_reply(send, request.rid, *error_reply(exc, request.rid))
            return
        await serve_prediction(request, scope["app"].state.shardserve, predict_work)

    async def predict(request: Request) -> Response:
        return RawAnswer(predict_model, served, None)

    async def predict_named(name: str, request: Request) -> Response:
        return RawAnswer(predict_model, name, None)

    # Declared for the OpenAPI document; the fast path answers them (ShardServeApp).
    predict_doc: dict[str, Any] = {
        "openapi_extra": PREDICT_REQUEST,
        "responses": {**ok(PREDICT_RESPONSE), **errors(400, 413, 422, 500, 503, 504)},
        "description": _PREDICT_DESCRIPTION,
    }
    app.add_api_route("/predict", predict, methods=["POST"], **predict_doc)
    app.add_api_route(
        "/v1/models/{name}:predict",
        predict_named,
        methods=["POST"],
        **{**predict_doc, "responses": {**predict_doc["responses"], **errors(404)}},
    )
    if isinstance(app, ShardServeApp):
        _install_fast_routes(app.fast_routes, predict_model, served)

    # Each GET returns its declared model (response_model), so that the document cannot drift
    # from the bodies: a key the model lacks fails the route (extra="forbid"). Unset keys are
    # left out, as optional ones were before.
    @app.get(
        "/v1/models/{name:model_status}",
        response_model=ModelStatus,
        response_model_exclude_unset=True,
        responses=errors(404),
    )
    async def model_status(name: str, request: Request) -> dict[str, Any]:
        check_name(name)
        state = _state(request)
        health = state.runner.health() if state.runner is not None else None
        failure = state.load_error or state.batcher_failure
        ready = state.ready.is_set() and not failure and (health is None or health.ok)
        version = {
            "version": "1",
            "state": "AVAILABLE" if ready else ("FAILED" if failure else "LOADING"),
            "status": {
                "error_code": "OK" if ready else "UNAVAILABLE",
                "error_message": failure or "",
            },
        }
        body: dict[str, Any] = {"model_version_status": [version]}
        if health is not None:
            body["replicas"] = {"total": health.replicas, "healthy": health.healthy}
        return body

    @app.get("/v1/models/{name}/metadata", response_model=ModelMetadata, responses=errors(404, 503))
    async def model_metadata(name: str, request: Request) -> dict[str, Any]:
        check_name(name)
        state = _state(request)
        if state.runner is None:
            raise NotReadyError("model is still loading; its signature is not known yet")
        runner = state.runner
        batcher = state.batcher
        return {
            "model_spec": {"name": served, "version": "1"},
            **runner.signature.to_json(),
            "name": served,
            "num_stages": runner.num_stages,
            "replicas": runner.replicas,
            "max_batch_size": batcher.policy.max_batch_size if batcher else settings.max_batch_size,
        }

    @app.get("/healthz", response_model=Alive)
    async def healthz() -> dict[str, Any]:
        return {"status": "alive"}

    not_ready: dict[int | str, dict[str, Any]] = {
        503: {"model": Readiness, "description": _NOT_READY}
    }

    def unready(response: Response, body: dict[str, Any]) -> dict[str, Any]:
        response.status_code = 503
        return body

    @app.get(
        "/readyz",
        response_model=Readiness,
        response_model_exclude_unset=True,
        responses=not_ready,
    )
    async def readyz(request: Request, response: Response) -> dict[str, Any]:
        state = _state(request)
        if state.load_error:
            return unready(response, {"status": "failed", "error": state.load_error})
        if not state.ready.is_set():
            waiting = {"error": state.load_waiting} if state.load_waiting else {}
            return unready(response, {"status": "loading", **waiting})
        if not state.accepting:
            return unready(response, {"status": "shutting down"})
        if state.batcher_failure:
            return unready(response, {"status": "failed", "error": state.batcher_failure})
        health = state.runner.health() if state.runner is not None else None
        if health is not None and not health.ok:
            reason = f"no healthy replica of {health.replicas}; rebuilding"
            if health.reason:
                reason += f" (last fault: {health.reason})"
            return unready(response, {"status": "unavailable", "error": reason})
        return {"status": "ready", "model": served}

    @app.get("/metrics", response_class=PlainTextResponse, responses=_METRICS_DOC)
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")


def _install_fast_routes(routes: FastRoutes, predict: RawHandler, served: str) -> None:
    routes.add_raw("/predict", predict, name=served)
    routes.add_raw("/v1/models/{name}:predict", predict)
    routes.add_raw("/v2/models/{name}/infer", v2_infer)
    routes.add_raw("/v2/models/{name}/versions/{version}/infer", v2_infer)


_PREDICT_DESCRIPTION = (
    "TF-Serving JSON. Header X-Request-Timeout-Ms (a positive number of ms) shortens the "
    "request's deadline. A request is refused from its headers before its body is read when its "
    "Content-Length is over max_body_bytes (413) or the queue is full (503)."
)
_NOT_READY = "Loading, failed to load, stopping, or no healthy replica (the reason in 'error')."
_METRICS_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}
