"""The HTTP API: routes, the lifespan that owns every resource, and the one error-to-status map."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.batcher import Batcher, BatchingPolicy
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
from serving.metrics import Metrics
from serving.runner import ModelRunner, build_runner

log = logging.getLogger("shardserve")
RunnerFactory = Callable[[Settings], Awaitable[ModelRunner]]
TIMEOUT_HEADER = "x-request-timeout-ms"
_STATS_PERIOD_S = 5.0
_DRAIN_TIMEOUT_S = 30.0
_CLOSE_TIMEOUT_S = 10.0


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    runner: ModelRunner | None = None
    batcher: Batcher | None = None
    load_error: str | None = None
    accepting: bool = False
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    loaded: asyncio.Event = field(default_factory=asyncio.Event)

    def require_batcher(self) -> Batcher:
        if self.load_error:
            raise NotReadyError(f"model failed to load: {self.load_error}")
        if self.batcher is None or not self.ready.is_set():
            raise NotReadyError("model is still loading; retry when GET /readyz answers 200")
        if not self.accepting:
            raise NotReadyError("server is shutting down")
        return self.batcher


def json_response(
    content: Any, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status_code, media_type="application/json", headers=headers)


def policy_from_settings(settings: Settings, runner: ModelRunner) -> BatchingPolicy:
    depth = runner.num_stages * getattr(runner, "replicas", 1)
    return BatchingPolicy(
        max_batch_size=settings.max_batch_size,
        batch_timeout_ms=None if settings.timeout_is_auto else float(settings.batch_timeout_ms),
        max_inflight_batches=settings.inflight_batches(depth),
        max_queue_rows=settings.queue_rows(depth),
        allowed_batch_sizes=settings.batch_sizes(),
        slo_p99_ms=settings.slo_p99_ms,
    )


def describe_error(exc: BaseException) -> str:
    """One line for clients: the root cause of a remote (Ray) error, never its traceback."""
    cause = getattr(exc, "cause", None)
    root = cause if isinstance(cause, BaseException) else exc
    first = (str(root).strip().splitlines() or [""])[0]
    return f"{type(root).__name__}: {first}"[:500]


async def _load(
    state: ServerState, factory: RunnerFactory, on_failure: Callable[[str], None] | None
) -> None:
    try:
        runner = await factory(state.settings)
        state.runner = runner
        state.loaded.set()
        batcher = Batcher(
            runner.run_batch,
            policy_from_settings(state.settings, runner),
            on_batch=state.metrics.observe_batch,
            on_reject=lambda reason: state.metrics.rejects.labels(reason).inc(),
        )
        await batcher.start()
        state.metrics.bind_gauges(
            lambda: batcher.queued_rows,
            lambda: batcher.inflight_batches,
            lambda: batcher.effective_wait_ms,
        )
        await _warm_up(runner)
        state.batcher = batcher
        state.accepting = True
        state.ready.set()
        log.info("ready: serving %r (%d stage(s))", state.settings.served_name(), runner.num_stages)
    except Exception as exc:  # any failure becomes a clear /readyz message, never a hang
        state.load_error = describe_error(exc)
        log.exception("model failed to load")
        state.loaded.set()
        if on_failure is not None:
            on_failure(state.load_error)


async def _warm_up(runner: ModelRunner) -> None:
    """One batch end to end, so the first user request does not pay for connection set-up."""
    inputs = {
        spec.name: np.zeros((1, *(d or 1 for d in spec.shape)), dtype=spec.np_dtype)
        for spec in runner.signature.inputs
    }
    await runner.run_batch(inputs)


async def _poll_stage_stats(state: ServerState) -> None:
    while True:
        runner = state.runner
        stats = getattr(runner, "stats", None)
        if stats is not None:
            with contextlib.suppress(Exception):
                state.metrics.set_stage_stats(await stats())
        await asyncio.sleep(_STATS_PERIOD_S)


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
        # Load in the background so /healthz and /readyz answer while the model loads.
        loader = asyncio.create_task(_load(state, runner_factory, on_load_failure))
        poller = asyncio.create_task(_poll_stage_stats(state))
        try:
            yield
        finally:
            state.accepting = False
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
    # Imported here because serving.admin builds on this module's state and helpers.
    from serving.admin import install_admin_routes

    install_admin_routes(app, settings)
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
        handler = self.fast_predict
        if handler is not None and scope["type"] == "http" and scope["method"] == "POST":
            path: str = scope["path"]
            name = None
            if path == "/predict":
                name = self.served_name
            elif path.startswith(_NAMED_PREFIX) and path.endswith(_NAMED_SUFFIX):
                name = path[len(_NAMED_PREFIX) : -len(_NAMED_SUFFIX)]
            if name is not None and "/" not in name:
                scope["app"] = self
                response = await handler(name, Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.shardserve
    return state


def error_response(exc: ShardServeError) -> Response:
    headers = None
    if isinstance(exc, QueueFullError):
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    return json_response({"error": exc.message}, exc.status_code, headers)


def _unexpected_response(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return json_response({"error": "internal server error; see the server log"}, 500)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ShardServeError)
    async def _shardserve_error(request: Request, exc: ShardServeError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return json_response({"error": str(exc.detail)}, exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return _unexpected_response(request, exc)


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


def _install_routes(app: FastAPI, settings: Settings) -> None:
    served = settings.served_name()

    def check_name(name: str) -> None:
        if name != served:
            raise NotFoundError(f"model {name!r} not found; this server serves {served!r}")

    async def predict(request: Request) -> Response:
        state = _state(request)
        started = time.perf_counter()
        status = "500"
        try:
            batcher = state.require_batcher()
            assert state.runner is not None
            body = await read_body(request, settings.max_body_bytes)
            decoded = decode_predict(body, state.runner.signature)
            deadline = request_deadline(request, settings)
            outputs = await until_disconnect(
                request, batcher.submit(decoded.inputs, deadline=deadline)
            )
            response = Response(
                encode_predict(outputs, state.runner.signature, decoded.form),
                media_type="application/json",
            )
            status = "200"
            return response
        except ClientGone:
            status = "499"
            state.metrics.rejects.labels("client_gone").inc()
            return Response(status_code=499)
        except ShardServeError as exc:
            status = str(exc.status_code)
            if isinstance(exc, InvalidInputError | PayloadTooLargeError):
                state.metrics.rejects.labels("invalid_input").inc()
            return error_response(exc)
        except Exception as exc:
            return _unexpected_response(request, exc)
        finally:
            state.metrics.request_latency.labels(status).observe(time.perf_counter() - started)

    async def predict_named(name: str, request: Request) -> Response:
        try:
            check_name(name)
        except NotFoundError as exc:
            return error_response(exc)
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
        ready = state.ready.is_set() and not state.load_error
        version = {
            "version": "1",
            "state": "AVAILABLE" if ready else ("FAILED" if state.load_error else "LOADING"),
            "status": {
                "error_code": "OK" if ready else "UNAVAILABLE",
                "error_message": state.load_error or "",
            },
        }
        return json_response({"model_version_status": [version]})

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
                "replicas": getattr(runner, "replicas", 1),
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
        return json_response({"status": "ready", "model": served})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")
