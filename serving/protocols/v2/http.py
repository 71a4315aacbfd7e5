"""The Open Inference Protocol (KServe V2) over HTTP/REST, on the same batcher as ``/predict``.

    GET  /v2                                        server metadata
    GET  /v2/health/live, /v2/health/ready          200 or 503
    GET  /v2/models/{m}[/versions/{v}]              model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready        200 or 503
    GET  /v2/models/{m}[/versions/{v}]/config       the part of Triton's model config clients read
    POST /v2/models/{m}[/versions/{v}]/infer        JSON, or JSON + binary tensors
    POST /v2/models/{m}[/versions/{v}]/generate     a generating model's completion
                                                    (``serving.protocols.v2.generate``)

The infer body's layout is ``serving.protocols.v2.infer_body``'s; the routes' OpenAPI
documentation and response models are ``serving.openapi.v2_bodies``', handed in by the server.
Every route finds its model by name (``serving.protocols.contract``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from starlette.types import Receive, Scope, Send

from serving.errors import InvalidInputError
from serving.http.fast import FastRequest, ModelRef, RawAnswer
from serving.http.replies import Reply
from serving.protocols.contract import ModelHandle, served_models
from serving.protocols.dataplane import submit
from serving.protocols.limits import request_limits
from serving.protocols.rest import serve_prediction
from serving.protocols.v2.generate import v2_generate
from serving.protocols.v2.infer_body import encode_infer, parse_infer
from serving.protocols.v2.metadata import model_config, model_metadata, server_metadata
from serving.quoting import quote

if TYPE_CHECKING:
    from serving.batching.batcher import Batcher

__all__ = ["ROUTE_KINDS", "RouteDocs", "install_v2_routes", "v2_infer"]

# What each kind of route is documented with: keyword arguments of ``add_api_route``
# (``response_model``, ``responses``, ``openapi_extra``), given by the server from
# ``serving.openapi.v2_bodies`` (a layer above this one).
RouteDocs = Mapping[str, Mapping[str, Any]]
ROUTE_KINDS = (
    "server_metadata",
    "live",
    "server_ready",
    "model_metadata",
    "model_ready",
    "model_config",
    "infer",
    "generate",
)


async def v2_infer(ref: ModelRef, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v2/models/{name}[/versions/{version}]/infer``; maps its own errors (a fast
    route's ``RawHandler``)."""
    request = FastRequest(scope, receive, send)
    await serve_prediction(request, served_models(scope["app"]), ref, _infer)


async def _infer(
    request: FastRequest, model: ModelHandle, batcher: Batcher, deadline: float
) -> Reply:
    encoding = request.content_encoding
    if encoding is not None and encoding.strip().lower() != "identity":
        raise InvalidInputError(
            f"Content-Encoding {quote(encoding.strip().lower())} is not served; send the body "
            "uncompressed"
        )
    settings = model.settings
    body = await request.body(settings.max_body_bytes, settings.body_read_timeout_s)
    signature = model.signature
    # Inline, as /predict decodes: a thread would hold the GIL as long.
    call = parse_infer(body, request.header_length, signature, request_limits(model, batcher))
    outputs = await request.until_disconnect(
        submit(call.inputs, model, batcher, deadline, request.request_id, call.timeout_s)
    )
    return encode_infer(outputs, call, signature, model.name, model.version)


def _model(request: Request, name: str, version: str | None) -> ModelHandle:
    # A look (metadata, readiness, config) takes no turn of a canary's split.
    return served_models(request.app).model(name, version, split=False)


# The GET handlers return their bodies as dicts, checked and sent by FastAPI against the
# route's response_model (given in ``docs``), so that the document cannot drift from them.
async def _metadata(name: str, request: Request, version: str | None = None) -> dict[str, Any]:
    model = _model(request, name, version)
    return model_metadata(model, served_models(request.app).versions(model.name))


async def _model_ready(
    name: str, request: Request, response: Response, version: str | None = None
) -> dict[str, Any]:
    ready = _model(request, name, version).available
    response.status_code = 200 if ready else 503
    return {"name": name, "ready": ready}


async def _config(name: str, request: Request, version: str | None = None) -> dict[str, Any]:
    return model_config(_model(request, name, version))


async def _infer_route(name: str, request: Request) -> Response:
    return RawAnswer(v2_infer, ModelRef(name))


async def _generate_route(name: str, request: Request) -> Response:
    return RawAnswer(v2_generate, ModelRef(name))


# The same handlers under /versions/{version}: FastAPI reads path parameters off the signature.
async def _metadata_v(name: str, version: str, request: Request) -> dict[str, Any]:
    return await _metadata(name, request, version)


async def _model_ready_v(
    name: str, version: str, request: Request, response: Response
) -> dict[str, Any]:
    return await _model_ready(name, request, response, version)


async def _config_v(name: str, version: str, request: Request) -> dict[str, Any]:
    return await _config(name, request, version)


async def _infer_route_v(name: str, version: str, request: Request) -> Response:
    return RawAnswer(v2_infer, ModelRef(name, version))


async def _generate_route_v(name: str, version: str, request: Request) -> Response:
    return RawAnswer(v2_generate, ModelRef(name, version))


async def _server_metadata() -> dict[str, Any]:
    return server_metadata()


async def _live() -> dict[str, Any]:
    return {"live": True}


async def _server_ready(request: Request, response: Response) -> dict[str, Any]:
    ready = served_models(request.app).available
    response.status_code = 200 if ready else 503
    return {"ready": ready}


def install_v2_routes(app: FastAPI, docs: RouteDocs) -> None:
    """The V2 routes, each documented with ``docs[kind]`` (a kind of ``ROUTE_KINDS``)."""

    def get(path: str, endpoint: Any, kind: str) -> None:
        app.add_api_route(
            path,
            endpoint,
            methods=["GET"],
            response_model_exclude_unset=True,  # dynamic_batching {} stays {}
            tags=["v2"],
            **docs[kind],
        )

    get("/v2", _server_metadata, "server_metadata")
    get("/v2/health/live", _live, "live")
    get("/v2/health/ready", _server_ready, "server_ready")
    for prefix, handlers in (
        ("/v2/models/{name}", (_metadata, _model_ready, _config, _infer_route, _generate_route)),
        (
            "/v2/models/{name}/versions/{version}",
            (_metadata_v, _model_ready_v, _config_v, _infer_route_v, _generate_route_v),
        ),
    ):
        metadata, ready, config, infer, generate = handlers
        get(prefix, metadata, "model_metadata")
        get(f"{prefix}/ready", ready, "model_ready")
        get(f"{prefix}/config", config, "model_config")
        app.add_api_route(f"{prefix}/infer", infer, methods=["POST"], tags=["v2"], **docs["infer"])
        app.add_api_route(
            f"{prefix}/generate", generate, methods=["POST"], tags=["v2"], **docs["generate"]
        )
