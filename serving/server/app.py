"""The HTTP API: the app, with the fast path for its predict and infer routes, its routes
(``serving.server.routes``, ``admin``, the V2 protocol's), the error-to-status map
(``serving.server.error_handlers``) and the lifespan that owns every resource
(``serving.server.lifespan``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.canary.split import CanarySplit
from serving.http.access import RouteLine
from serving.http.fast import FastPathLayer, FastRoutes
from serving.http.replies import REQUEST_ID_KEY, request_id_from, send_with_request_id
from serving.openapi.document import Served, document
from serving.openapi.tfserving import ROUTE_DOCS as TFSERVING_ROUTE_DOCS
from serving.openapi.v2_bodies import REPOSITORY_DOCS
from serving.openapi.v2_bodies import ROUTE_DOCS as V2_ROUTE_DOCS
from serving.protocols.openai.chat import v1_chat_completions
from serving.protocols.openai.completions import v1_completions
from serving.protocols.openai.models import install_model_list
from serving.protocols.rest import refuse_from_headers
from serving.protocols.tfserving.http import install_tfserving_routes
from serving.protocols.tfserving.predict import predict as predict_model
from serving.protocols.v2.generate import v2_generate, v2_generate_stream
from serving.protocols.v2.http import install_v2_routes, v2_infer
from serving.protocols.v2.http_repository import install_repository_routes
from serving.repository.manager import Repository
from serving.server.admin_routes import install_admin_routes
from serving.server.canary_routes import install_rollout_routes
from serving.server.error_handlers import install_error_handlers
from serving.server.lifespan import make_lifespan
from serving.server.routes import install_routes
from serving.server.state import ServerState
from serving.settings.config import Settings
from serving.telemetry import active
from serving.version.runner import RunnerFactory, build_runner, pipeline_depth

if TYPE_CHECKING:
    from shards.signature import ModelSignature

log = logging.getLogger("shardserve")


def create_app(
    settings: Settings,
    runner_factory: RunnerFactory = build_runner,
    *,
    on_load_failure: Callable[[str], None] | None = None,
) -> FastAPI:
    lifespan = make_lifespan(
        settings, lambda state: Repository(state, settings, runner_factory, on_load_failure)
    )
    # FastAPI's own OpenTelemetry off: it would turn on as soon as anything sets a global
    # tracer provider, and then every request would leave the fast path (``_untraced``). The
    # server's spans are its own (``serving.telemetry``), made on the fast path.
    app = ShardServeApp(
        title="shardserve",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    install_error_handlers(app)
    install_tfserving_routes(app, TFSERVING_ROUTE_DOCS, predict_model)
    install_routes(app)
    _install_fast_routes(app.fast_routes)
    install_admin_routes(app, settings)
    install_rollout_routes(app, settings)
    install_v2_routes(app, V2_ROUTE_DOCS)
    install_model_list(app)
    install_repository_routes(
        app,
        settings.admin_token,
        REPOSITORY_DOCS,
        body_timeout_s=settings.body_read_timeout_s,
        allow_plaintext_admin=settings.allow_plaintext_admin,
    )
    return app


def _install_fast_routes(routes: FastRoutes) -> None:
    """The routes the fast path answers (``serving.http.fast``); ``/predict`` is the default
    model's (``ServerState.model()``)."""
    routes.add_raw("/predict", predict_model)
    routes.add_raw("/v1/models/{name}:predict", predict_model)
    routes.add_raw("/v1/models/{name}/versions/{version}:predict", predict_model)
    routes.add_raw("/v1/models/{name}/labels/{label}:predict", predict_model)
    routes.add_raw("/v2/models/{name}/infer", v2_infer)
    routes.add_raw("/v2/models/{name}/versions/{version}/infer", v2_infer)
    routes.add_raw("/v2/models/{name}/generate", v2_generate)
    routes.add_raw("/v2/models/{name}/versions/{version}/generate", v2_generate)
    routes.add_raw("/v2/models/{name}/generate_stream", v2_generate_stream)
    routes.add_raw("/v2/models/{name}/versions/{version}/generate_stream", v2_generate_stream)
    # The OpenAI routes' model is named in the body: "" (no model's name) leaves them to the app,
    # never to the queue-full refusal from the headers (serving.http.protocol), which would look
    # at the default model's queue.
    routes.add_raw("/v1/completions", v1_completions, name="")
    routes.add_raw("/v1/chat/completions", v1_chat_completions, name="")
    # A full queue refused from the headers, inside uvicorn's protocol (serving.http.protocol).
    routes.refuse_from_headers = refuse_from_headers


class ShardServeApp(FastAPI):
    """FastAPI with the fast path (``serving.http.fast``) for the predict and infer routes, an
    ``X-Request-Id`` on every response, and an OpenAPI document that follows the served model.

    ``fast_routes`` holds the routes the fast path answers; they are declared on the router too,
    for the OpenAPI document.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_routes = FastRoutes()
        self._doc_key: Served | None = None
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
                handler, ref = hit
                scope["app"] = self
                await handler(ref, scope, receive, send)
                return
        # Outside every middleware, so that their own answers (a CORS preflight, a 500 from
        # ServerErrorMiddleware) carry the id too.
        send = send_with_request_id(send, rid)
        line = None
        access = active.access_log
        if access is not None and not (
            scope["method"] == "POST" and self.fast_routes.match_scope(scope) is not None
        ):  # a route outside the data plane (which logs the inference routes itself)
            line = RouteLine(scope, send, access)
            send = line.send
        try:
            if self._untraced and self.middleware_stack is not None:
                # FastAPI.__call__ asks OpenTelemetry on every request whether it is configured
                # (8 us, as much as the rest of the stack); the answer is taken once, at the
                # first request: telemetry configured later than that is not seen.
                scope["app"] = self
                await self.middleware_stack(scope, receive, send)
                return
            await super().__call__(scope, receive, send)
        finally:
            if line is not None:
                line.write()

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
        # Built once per set of served versions, not per request nor per batch settings (an
        # admin PUT changes that): the rows a request may hold are the start-up queue's, which
        # a PUT keeps.
        state: ServerState | None = getattr(self.state, "shardserve", None)
        served = _served(state) if state is not None else Served((), {}, None, None)
        if served != self._doc_key:
            self._doc = document(super().openapi(), served)
            self._doc_key = served
        return self._doc


def _served(state: ServerState) -> Served:
    """What the document follows: the names, versions and labels served, and the one signature
    (and the rows a request may hold) every served version shares, else none."""
    versions = []
    generating = set()
    shapes: set[tuple[ModelSignature | None, int | None]] = set()
    for model in state.served():
        versions.append((model.name, model.version))
        if model.generator is not None:
            generating.add(model.name)
        runner = model.runner
        if runner is None:  # loading: its signature is not known yet
            shapes.add((None, None))
            continue
        rows = model.settings.queue_rows(pipeline_depth(runner), runner.replicas)
        shapes.add((runner.signature, rows))
    labels = {name: tuple(sorted(by_label)) for name, by_label in state.labels.items()}
    signature, max_rows = shapes.pop() if len(shapes) == 1 else (None, None)
    return Served(
        tuple(versions), labels, signature, max_rows, _canaries(state), tuple(sorted(generating))
    )


def _canaries(state: ServerState) -> tuple[str, ...]:
    """The models with a canary's rollout (their admin routes answer more than 404)."""
    return tuple(sorted(n for n, split in state.traffic.items() if isinstance(split, CanarySplit)))


def _untraced(app: FastAPI) -> bool:
    """No root path to set and FastAPI's native telemetry off (unknown: assume on)."""
    telemetry = getattr(app, "_native_telemetry", None)
    enabled = getattr(telemetry, "enabled", None)
    return not app.root_path and callable(enabled) and not enabled()
