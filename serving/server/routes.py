"""The server's own routes: ``/healthz``, ``/readyz`` and ``/metrics`` (TF Serving's are
``serving.protocols.tfserving.http``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from serving.openapi.bodies import Alive, Readiness
from serving.version.readiness import readiness

if TYPE_CHECKING:
    from serving.server.state import ServerState

__all__ = ["install_routes"]


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.shardserve
    return state


def install_routes(app: FastAPI) -> None:
    """The routes above."""
    not_ready: dict[int | str, dict[str, Any]] = {
        503: {"model": Readiness, "description": _NOT_READY}
    }

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
        for model in state.served() if state is not None else ():
            condition = model.condition()
            if condition.gave_up:
                body = {"status": "failed", "error": condition.unavailable}
                return JSONResponse(body, status_code=503)
        return {"status": "alive"}

    @app.get(
        "/readyz",
        response_model=Readiness,
        response_model_exclude_unset=True,
        responses=not_ready,
    )
    async def readyz(request: Request, response: Response) -> dict[str, Any]:
        # Ready once no version is still loading and at least one is ready (readiness.py).
        found = readiness(_state(request))
        if found.status != "ready":
            response.status_code = 503
        return found.body()

    @app.get("/metrics", response_class=PlainTextResponse, responses=_METRICS_DOC)
    async def metrics(request: Request) -> Response:
        # OpenMetrics where the scraper asks for it (Prometheus does, by its Accept header):
        # the latency buckets' exemplars (a sampled request's trace id) exist only there.
        if "application/openmetrics-text" in request.headers.get("accept", ""):
            return Response(_state(request).metrics.render(openmetrics=True), media_type=_OM)
        return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")


_GAVE_UP = "A model's batcher gave up after crashing again and again: restart the process."
_NOT_READY = "Loading, failed to load, stopping, or no healthy replica (the reason in 'error')."
_OM = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_METRICS_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition format; OpenMetrics (with the latency "
        "buckets' exemplars: trace ids) where the Accept header asks for it",
        "content": {
            "text/plain": {"schema": {"type": "string"}},
            "application/openmetrics-text": {"schema": {"type": "string"}},
        },
    }
}
