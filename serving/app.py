"""The HTTP API: routes, the lifespan that owns every resource, and the error-to-status map."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.admin import install_admin_routes
from serving.codec import decode_predict, encode_predict
from serving.config import Settings
from serving.errors import (
    InvalidInputError,
    NotFoundError,
    NotReadyError,
    PayloadTooLargeError,
    QueueFullError,
    ShardServeError,
)
from serving.http_io import (
    REQUEST_ID_HEADER,
    REQUEST_ID_KEY,
    ClientGone,
    check_content_length,
    check_headroom,
    error_response,
    json_response,
    log_failure,
    read_body,
    request_deadline,
    request_id,
    request_id_from,
    send_with_request_id,
    unexpected_response,
    until_disconnect,
)
from serving.runner import build_runner
from serving.state import RunnerFactory, ServerState, load_model, poll_stage_stats
from serving.v2.grpc_server import start_grpc_server, stop_grpc_server
from serving.v2.http import install_v2_routes

log = logging.getLogger("shardserve")
_DRAIN_TIMEOUT_S = 30.0
_CLOSE_TIMEOUT_S = 10.0
# Bodies above this are decoded on a worker thread: parsing 1 MiB of JSON holds the event loop
# for milliseconds, and batch timers (and every other request) would wait for it.
_INLINE_DECODE_BYTES = 256 * 1024


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
            state.accepting = False
            await stop_grpc_server(grpc_server)
            poller.cancel()
            loader.cancel()
            await asyncio.gather(loader, poller, return_exceptions=True)
            if state.batcher is not None:
                try:
                    await asyncio.wait_for(state.batcher.stop(drain=True), _DRAIN_TIMEOUT_S)
                except TimeoutError:
                    log.warning("drain took over %.0f s; failing what is left", _DRAIN_TIMEOUT_S)
                    await state.batcher.stop(drain=False)
            if state.runner is not None:
                try:
                    await asyncio.wait_for(state.runner.close(), _CLOSE_TIMEOUT_S)
                except Exception:  # a dead Ray must not keep the process from exiting
                    log.warning("closing the model runner failed", exc_info=True)

    app = ShardServeApp(title="shardserve", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.served_name = settings.served_name()
    _install_error_handlers(app)
    _install_routes(app, settings)
    install_admin_routes(app, settings)
    install_v2_routes(app, settings)
    return app


PredictHandler = Callable[[str, Request], Awaitable[Response]]
_NAMED_PREFIX, _NAMED_SUFFIX = "/v1/models/", ":predict"


class ShardServeApp(FastAPI):
    """FastAPI with the predict routes answered before its middleware stack and router.

    py-spy on /predict at 64 clients: over half of the server's CPU went to Starlette and
    FastAPI layers (exception and telemetry middleware, routing, dependency solving) around a
    handler that only reads the body and awaits the batcher. The handler maps its own errors,
    so skipping those layers changes no answer.
    """

    fast_predict: PredictHandler | None = None
    served_name: str = ""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        rid = request_id_from(scope["headers"])
        scope[REQUEST_ID_KEY] = rid
        handler = self.fast_predict
        if handler is not None and scope["method"] == "POST":
            path: str = scope["path"]
            name = None
            if path == "/predict":
                name = self.served_name
            elif path.startswith(_NAMED_PREFIX) and path.endswith(_NAMED_SUFFIX):
                name = path[len(_NAMED_PREFIX) : -len(_NAMED_SUFFIX)]
            if name is not None and "/" not in name:
                scope["app"] = self
                response = await handler(name, Request(scope, receive, send))
                response.raw_headers.append((REQUEST_ID_HEADER, rid))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send_with_request_id(send, rid))


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
        return json_response({"error": str(exc.detail)}, exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return unexpected_response(request, exc)


def _install_routes(app: FastAPI, settings: Settings) -> None:
    served = settings.served_name()

    def check_name(name: str) -> None:
        if name != served:
            raise NotFoundError(f"model {name!r} not found; this server serves {served!r}")

    async def predict(request: Request) -> Response:
        state = _state(request)
        started = time.perf_counter()
        status = "500"
        rid = request_id(request)
        try:
            batcher = state.require_batcher()
            runner = state.runner
            assert runner is not None
            # Admission from the headers alone: a refused request costs no body read, no decode.
            check_content_length(request, settings.max_body_bytes)
            try:
                check_headroom(batcher)
            except QueueFullError:
                state.metrics.rejects.labels("queue_full").inc()
                raise
            deadline = request_deadline(request, settings)
            body = await read_body(request, settings.max_body_bytes)
            if len(body) > _INLINE_DECODE_BYTES:
                decoded = await asyncio.to_thread(decode_predict, body, runner.signature)
            else:
                decoded = decode_predict(body, runner.signature)
            outputs = await until_disconnect(
                request, batcher.submit(decoded.inputs, deadline=deadline, request_id=rid)
            )
            response = Response(
                encode_predict(outputs, runner.signature, decoded.form),
                media_type="application/json",
            )
            status = "200"
            return response
        except ClientGone:
            status = "499"
            state.metrics.rejects.labels("client_gone").inc()
            log_failure(rid, 499, "the client went away before its answer was ready")
            return Response(status_code=499)
        except ShardServeError as exc:
            status = str(exc.status_code)
            if isinstance(exc, InvalidInputError | PayloadTooLargeError):
                state.metrics.rejects.labels("invalid_input").inc()
            return error_response(exc, rid)
        except Exception as exc:
            return unexpected_response(request, exc)
        finally:
            state.metrics.request_latency.labels(status).observe(time.perf_counter() - started)

    async def predict_named(name: str, request: Request) -> Response:
        try:
            check_name(name)
        except NotFoundError as exc:
            return error_response(exc, request_id(request))
        return await predict(request)

    # The routes document the API (OpenAPI); ShardServeApp answers them before the router.
    app.add_api_route("/predict", predict, methods=["POST"])
    app.add_api_route("/v1/models/{name}:predict", predict_named, methods=["POST"])
    if isinstance(app, ShardServeApp):
        app.fast_predict = predict_named

    @app.get("/v1/models/{name}")
    async def model_status(name: str, request: Request) -> Response:
        check_name(name)
        state = _state(request)
        health = state.runner.health() if state.runner is not None else None
        ready = state.ready.is_set() and not state.load_error and (health is None or health.ok)
        version = {
            "version": "1",
            "state": "AVAILABLE" if ready else ("FAILED" if state.load_error else "LOADING"),
            "status": {
                "error_code": "OK" if ready else "UNAVAILABLE",
                "error_message": state.load_error or "",
            },
        }
        body: dict[str, Any] = {"model_version_status": [version]}
        if health is not None:
            body["replicas"] = {"total": health.replicas, "healthy": health.healthy}
        return json_response(body)

    @app.get("/v1/models/{name}/metadata")
    async def model_metadata(name: str, request: Request) -> Response:
        check_name(name)
        state = _state(request)
        if state.runner is None:
            raise NotReadyError("model is still loading; its signature is not known yet")
        runner = state.runner
        batcher = state.batcher
        return json_response(
            {
                "model_spec": {"name": served, "version": "1"},
                **runner.signature.to_json(),
                "name": served,
                "num_stages": runner.num_stages,
                "replicas": runner.replicas,
                "max_batch_size": batcher.policy.max_batch_size
                if batcher
                else settings.max_batch_size,
            }
        )

    @app.get("/healthz")
    async def healthz() -> Response:
        return json_response({"status": "alive"})

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        state = _state(request)
        if state.load_error:
            return json_response({"status": "failed", "error": state.load_error}, 503)
        if not state.ready.is_set():
            return json_response({"status": "loading"}, 503)
        if not state.accepting:
            return json_response({"status": "shutting down"}, 503)
        health = state.runner.health() if state.runner is not None else None
        if health is not None and not health.ok:
            reason = f"no healthy replica of {health.replicas}; rebuilding"
            if health.reason:
                reason += f" (last fault: {health.reason})"
            return json_response({"status": "unavailable", "error": reason}, 503)
        return json_response({"status": "ready", "model": served})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")
