"""The server's own routes: TF-Serving's predict, model status and metadata (each looks its model
up by name in ``ServerState.models``; ``/predict`` serves the default one), ``/healthz``,
``/readyz`` and ``/metrics``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.convertors import Convertor, register_url_convertor

from serving.config import Settings
from serving.errors import NotReadyError
from serving.http.fast import RawAnswer, RawHandler
from serving.openapi.bodies import Alive, ModelMetadata, ModelStatus, Readiness, errors, ok
from serving.openapi.tfserving import PREDICT_REQUEST, PREDICT_RESPONSE

if TYPE_CHECKING:
    from serving.server.state import ServerState

__all__ = ["install_routes"]


class _StatusName(Convertor[str]):
    """The {name} of GET /v1/models/{name}: not one that ends in ``:predict``, which is the
    POST route's (so that its 405 names only POST)."""

    regex = r"[^/]+(?<!:predict)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("model_status", _StatusName())


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.shardserve
    return state


def install_routes(app: FastAPI, settings: Settings, predict_model: RawHandler) -> None:
    """The routes above; ``predict_model`` answers TF-Serving's predict (the fast path answers
    it before the router where it can: these declare it for the OpenAPI document)."""
    served = settings.served_name()

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
        model = _state(request).model(name)
        health = model.health()
        failure = model.load_error or model.batcher_failure
        ready = model.ready.is_set() and not failure and (health is None or health.ok)
        version = {
            "version": model.version,
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
        model = _state(request).model(name)
        runner = model.runner
        if runner is None:
            raise NotReadyError("model is still loading; its signature is not known yet")
        batching = model.batch_settings
        return {
            "model_spec": {"name": model.name, "version": model.version},
            **runner.signature.to_json(),
            "name": model.name,
            "num_stages": runner.num_stages,
            "replicas": runner.replicas,
            "max_batch_size": batching.max_batch_size if batching else settings.max_batch_size,
        }

    not_ready: dict[int | str, dict[str, Any]] = {
        503: {"model": Readiness, "description": _NOT_READY}
    }

    def unready(response: Response, body: dict[str, Any]) -> dict[str, Any]:
        response.status_code = 503
        return body

    @app.get(
        "/healthz",
        response_model=Alive,
        responses={503: {"model": Readiness, "description": _GAVE_UP}},
    )
    async def healthz(request: Request) -> Any:
        # A batcher that gave up (its loop crashed again and again) will not come back in this
        # process: liveness fails, so that an orchestrator restarts it instead of only taking
        # it out of service as /readyz does.
        state = getattr(request.app.state, "shardserve", None)
        for model in state.models.values() if state is not None else ():
            if model.batcher_failure:
                body = {"status": "failed", "error": model.batcher_failure}
                return JSONResponse(body, status_code=503)
        return {"status": "alive"}

    @app.get(
        "/readyz",
        response_model=Readiness,
        response_model_exclude_unset=True,
        responses=not_ready,
    )
    async def readyz(request: Request, response: Response) -> dict[str, Any]:
        state = _state(request)
        model = state.model()
        if model.load_error:
            return unready(response, {"status": "failed", "error": model.load_error})
        if not model.ready.is_set():
            waiting = {"error": model.load_waiting} if model.load_waiting else {}
            return unready(response, {"status": "loading", **waiting})
        if not state.accepting:
            return unready(response, {"status": "shutting down"})
        if model.batcher_failure:
            return unready(response, {"status": "failed", "error": model.batcher_failure})
        health = model.health()
        if health is not None and not health.ok:
            reason = f"no healthy replica of {health.replicas}; rebuilding"
            if health.reason:
                reason += f" (last fault: {health.reason})"
            return unready(response, {"status": "unavailable", "error": reason})
        return {"status": "ready", "model": model.name}

    @app.get("/metrics", response_class=PlainTextResponse, responses=_METRICS_DOC)
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")


_PREDICT_DESCRIPTION = (
    "TF-Serving JSON. Header X-Request-Timeout-Ms (a positive number of ms) shortens the "
    "request's deadline. A request is refused from its headers before its body is read when its "
    "Content-Length is over max_body_bytes (413) or the queue is full (503)."
)
_GAVE_UP = "A model's batcher gave up after crashing again and again: restart the process."
_NOT_READY = "Loading, failed to load, stopping, or no healthy replica (the reason in 'error')."
_METRICS_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}
