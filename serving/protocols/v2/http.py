"""The Open Inference Protocol (KServe V2) over HTTP/REST, on the same batcher as ``/predict``.

    GET  /v2                                        server metadata
    GET  /v2/health/live, /v2/health/ready          200 or 503
    GET  /v2/models/{m}[/versions/{v}]              model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready        200 or 503
    GET  /v2/models/{m}[/versions/{v}]/config       the part of Triton's model config clients read
    POST /v2/models/{m}[/versions/{v}]/infer        JSON, or JSON + binary tensors

The infer body's layout is ``serving.protocols.v2.infer_body``'s, the OpenAPI schemas
``http_docs``'.
"""

from __future__ import annotations

import functools
import importlib.metadata
import time
from typing import Any

from fastapi import FastAPI, Request, Response
from starlette.types import Receive, Scope, Send

from serving.batching.batcher import Batcher
from serving.config import Settings
from serving.errors import (
    InvalidInputError,
    NotFoundError,
    NotReadyError,
)
from serving.http.raw import FastRequest, RawAnswer, Reply
from serving.openapi import v2_bodies as http_docs
from serving.protocols.tfserving.predict import serve_prediction
from serving.protocols.v2.infer_body import VERSION, encode_infer, parse_infer
from serving.protocols.v2.tensors import tensor_config, tensor_metadata
from serving.server.runner import ModelRunner
from serving.server.state import ServerState
from shards.signature import ModelSignature

__all__ = ["install_v2_routes", "v2_infer"]

SERVER_NAME = "shardserve"
EXTENSIONS = ["binary_tensor_data", "model_configuration"]
PLATFORM = "tensorflow_keras"


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.shardserve
    return state


@functools.lru_cache(maxsize=16)
def _served_name(model: str, model_name: str | None) -> str:
    return Settings.model_construct(model=model, model_name=model_name).served_name()


def served_name(settings: Settings) -> str:
    """``settings.served_name()``, computed once per (model, model_name): it parses the model
    path with pathlib (4 us), twice per infer request; py-spy put it at 7.6% of the front end's
    time on V2 binary infer of the light model (docs/benchmarks.md, issue 11)."""
    return _served_name(settings.model, settings.model_name)


def _check_model(state: ServerState, name: str, version: str | None) -> None:
    served = served_name(state.settings)
    if name != served:
        raise NotFoundError(f"model {name!r} not found; this server serves {served!r}")
    if version is not None and version != VERSION:
        raise NotFoundError(f"model {name!r} has no version {version!r}; its versions: ['1']")


def _not_ready_reason(state: ServerState) -> str | None:
    if state.load_error:
        return f"model failed to load: {state.load_error}"
    if not state.ready.is_set():
        return "model is still loading"
    if not state.accepting:
        return "server is shutting down"
    if state.batcher_failure:
        return state.batcher_failure
    health = state.runner.health() if state.runner is not None else None
    if health is not None and not health.ok:
        return f"no healthy replica of {health.replicas}; rebuilding"
    return None


async def v2_infer(
    name: str, version: str | None, scope: Scope, receive: Receive, send: Send
) -> None:
    """``POST /v2/models/{name}[/versions/{version}]/infer``; maps its own errors (fast path)."""
    state: ServerState = scope["app"].state.shardserve
    request = FastRequest(scope, receive, send)
    await serve_prediction(
        request, state, _infer_work, check=lambda: _check_model(state, name, version)
    )


async def _infer_work(
    request: FastRequest, batcher: Batcher, runner: ModelRunner, deadline: float, rid: str
) -> Reply:
    settings = request.scope["app"].state.shardserve.settings
    # The check before this one made sure it is the served model's name.
    name = served_name(settings)
    encoding = request.content_encoding
    if encoding is not None and encoding.strip().lower() != "identity":
        raise InvalidInputError(
            f"Content-Encoding {encoding.strip().lower()!r} is not served; send the body "
            "uncompressed"
        )
    body = await request.body(settings.max_body_bytes)
    header_length = request.header_length
    # Inline, as /predict decodes (serving.server.app): a thread would hold the GIL as long.
    call = parse_infer(body, header_length, runner.signature)
    if call.timeout_s is not None:
        deadline = min(deadline, time.monotonic() + call.timeout_s)
    outputs = await request.until_disconnect(
        batcher.submit(call.inputs, deadline=deadline, request_id=rid)
    )
    return encode_infer(outputs, call, runner.signature, name)


# ---- metadata, health, config -----------------------------------------------------------------


def server_metadata() -> dict[str, Any]:
    return {
        "name": SERVER_NAME,
        "version": importlib.metadata.version("shardserve"),
        "extensions": EXTENSIONS,
    }


def model_metadata(name: str, signature: ModelSignature) -> dict[str, Any]:
    return {
        "name": name,
        "versions": [VERSION],
        "platform": PLATFORM,
        "inputs": [tensor_metadata(spec) for spec in signature.inputs],
        "outputs": [tensor_metadata(spec) for spec in signature.outputs],
    }


def model_config(state: ServerState, name: str, signature: ModelSignature) -> dict[str, Any]:
    settings = state.settings
    policy = state.batcher.policy if state.batcher is not None else None
    max_batch = policy.max_batch_size if policy is not None else settings.max_batch_size
    wait_ms = policy.batch_timeout_ms if policy is not None else None
    if policy is None and not settings.timeout_is_auto:
        wait_ms = float(settings.batch_timeout_ms)
    batching: dict[str, Any] = {}
    if wait_ms is not None:  # None: the adaptive (auto) wait
        batching["max_queue_delay_microseconds"] = round(wait_ms * 1000)
    return {
        "name": name,
        "platform": PLATFORM,
        "backend": SERVER_NAME,
        "max_batch_size": max_batch,
        "input": [tensor_config(spec) for spec in signature.inputs],
        "output": [tensor_config(spec) for spec in signature.outputs],
        "dynamic_batching": batching,
    }


def _signature(state: ServerState) -> ModelSignature:
    if state.runner is None:
        raise NotReadyError("model is still loading; its signature is not known yet")
    return state.runner.signature


# The GET handlers return their bodies as dicts, checked and sent by FastAPI against the
# route's response_model (``http_docs``), so that the document cannot drift from them.
async def _metadata(name: str, request: Request, version: str | None = None) -> dict[str, Any]:
    state = _state(request)
    _check_model(state, name, version)
    return model_metadata(name, _signature(state))


async def _model_ready(
    name: str, request: Request, response: Response, version: str | None = None
) -> dict[str, Any]:
    state = _state(request)
    _check_model(state, name, version)
    ready = _not_ready_reason(state) is None
    response.status_code = 200 if ready else 503
    return {"name": name, "ready": ready}


async def _config(name: str, request: Request, version: str | None = None) -> dict[str, Any]:
    state = _state(request)
    _check_model(state, name, version)
    return model_config(state, name, _signature(state))


async def _infer(name: str, request: Request) -> Response:
    return RawAnswer(v2_infer, name, None)


# The same handlers under /versions/{version}: FastAPI reads path parameters off the signature.
async def _metadata_v(name: str, version: str, request: Request) -> dict[str, Any]:
    return await _metadata(name, request, version)


async def _model_ready_v(
    name: str, version: str, request: Request, response: Response
) -> dict[str, Any]:
    return await _model_ready(name, request, response, version)


async def _config_v(name: str, version: str, request: Request) -> dict[str, Any]:
    return await _config(name, request, version)


async def _infer_v(name: str, version: str, request: Request) -> Response:
    return RawAnswer(v2_infer, name, version)


async def _server_metadata() -> dict[str, Any]:
    return server_metadata()


async def _live() -> dict[str, Any]:
    return {"live": True}


async def _server_ready(request: Request, response: Response) -> dict[str, Any]:
    ready = _not_ready_reason(_state(request)) is None
    response.status_code = 200 if ready else 503
    return {"ready": ready}


def install_v2_routes(app: FastAPI, settings: Settings) -> None:
    """The V2 routes. They read the settings from the app state at request time (as the fast
    path's direct call of ``v2_infer`` must), so ``settings`` only completes the signature."""

    def get(path: str, endpoint: Any, doc: http_docs.Get) -> None:
        model, responses = doc
        app.add_api_route(
            path,
            endpoint,
            methods=["GET"],
            response_model=model,
            response_model_exclude_unset=True,  # dynamic_batching {} stays {}
            responses=responses,
            tags=["v2"],
        )

    get("/v2", _server_metadata, http_docs.SERVER_METADATA)
    get("/v2/health/live", _live, http_docs.LIVE)
    get("/v2/health/ready", _server_ready, http_docs.SERVER_READY)
    for prefix, handlers in (
        ("/v2/models/{name}", (_metadata, _model_ready, _config, _infer)),
        (
            "/v2/models/{name}/versions/{version}",
            (_metadata_v, _model_ready_v, _config_v, _infer_v),
        ),
    ):
        metadata, ready, config, infer = handlers
        get(prefix, metadata, http_docs.MODEL_METADATA)
        get(f"{prefix}/ready", ready, http_docs.MODEL_READY)
        get(f"{prefix}/config", config, http_docs.MODEL_CONFIG)
        app.add_api_route(
            f"{prefix}/infer",
            infer,
            methods=["POST"],
            responses=http_docs.INFER,
            openapi_extra=http_docs.INFER_REQUEST,
            tags=["v2"],
        )
