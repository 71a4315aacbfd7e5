"""OpenAPI documentation of the V2 routes' bodies, and the models their GET answers are sent
through (``response_model``). Never used to parse a request: orjson and numpy read the payload
(``serving.protocols.v2.infer_body``). ``ROUTE_DOCS`` is what the server hands to
``serving.protocols.v2.http.install_v2_routes``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from serving.protocols.v2.datatypes import DATATYPES

__all__ = ["INFER", "INFER_REQUEST", "REPOSITORY_DOCS", "ROUTE_DOCS"]

Responses = dict[int | str, dict[str, Any]]
Datatype = Literal[DATATYPES]  # type: ignore[valid-type]


class _Body(BaseModel):
    """A response body the routes return as is (``response_model``): a key the model lacks
    fails the route, so the document cannot drift from what is sent."""

    model_config = ConfigDict(extra="forbid")


class V2ErrorBody(_Body):
    error: str


class V2ServerMetadata(_Body):
    name: str
    version: str
    extensions: list[str]


class V2LiveResponse(_Body):
    live: bool


class V2ReadyResponse(_Body):
    ready: bool


class V2ModelReadyResponse(_Body):
    name: str
    ready: bool


class V2TensorMetadata(_Body):
    name: str
    datatype: Datatype
    shape: list[int]


class V2ModelMetadata(_Body):
    name: str
    versions: list[str]
    platform: str
    inputs: list[V2TensorMetadata]
    outputs: list[V2TensorMetadata]
    # {"length_padding": {"inputs", "buckets", "outputs_cut_back"} or {"off": why}}, where the
    # model takes an input of unknown length; "replicas": {"min_replicas", "max_replicas",
    # "target_replicas", "reason", "detail", "pending"} once it serves.
    parameters: dict[str, Any] | None = None


class V2ConfigTensor(_Body):
    name: str
    data_type: str
    dims: list[int]


class V2DynamicBatching(_Body):
    max_queue_delay_microseconds: int | None = None


class V2ModelConfig(_Body):
    name: str
    platform: str
    backend: str
    max_batch_size: int
    input: list[V2ConfigTensor]
    output: list[V2ConfigTensor]
    dynamic_batching: V2DynamicBatching


class V2RepositoryEntry(_Body):
    """One (model, version) of the repository index: its state and why (one line, empty when
    READY); no version for a model with no complete version on disk."""

    name: str
    version: str | None = None
    state: Literal["READY", "LOADING", "UNAVAILABLE"]
    reason: str


class V2RepositoryDone(_Body):
    """A load or unload done: an empty object (Triton's body is empty; clients read only the
    status)."""


class V2RequestInput(BaseModel):
    name: str
    shape: list[int]
    datatype: Datatype
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class V2RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class V2InferenceRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[V2RequestInput]
    outputs: list[V2RequestOutput] | None = None


class V2ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: Datatype
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class V2InferenceResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[V2ResponseOutput]


class V2GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    # A priority level (``priority_levels``; default ``default_priority``); else ``X-Priority``.
    priority: str | None = None


class V2GenerateRequest(BaseModel):
    """Exactly one of ``text_input`` (a model with a tokenizer) and ``input_ids``."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    text_input: str | None = None
    input_ids: list[int] | None = None
    parameters: V2GenerateParameters | None = None


class V2GenerateResponse(BaseModel):
    model_name: str
    model_version: str
    text_output: str | None = None
    output_ids: list[int]
    finish_reason: Literal["stop", "length"]


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    """``schema`` with its ``#/$defs/...`` references replaced by the definitions themselves."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline(v, defs) for v in schema]
    return schema


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    inlined: dict[str, Any] = _inline(schema, schema.get("$defs", {}))
    return inlined


_BINARY_BODY = {
    "schema": {"type": "string", "format": "binary"},
    "description": "The JSON object (its length in Inference-Header-Content-Length), then the "
    "raw little-endian bytes of each binary tensor in order",
}
_ERROR = {"model": V2ErrorBody}

# openapi_extra of the infer routes: the handler reads the body itself.
INFER_REQUEST: dict[str, Any] = {
    "parameters": [
        {
            "name": "Inference-Header-Content-Length",
            "in": "header",
            "required": False,
            "description": "Length in bytes of the JSON object when binary tensor data follow it",
            "schema": {"type": "integer", "minimum": 0},
        }
    ],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": _schema(V2InferenceRequest)},
            "application/octet-stream": _BINARY_BODY,
        },
    },
}
INFER: Responses = {
    200: {
        "model": V2InferenceResponse,
        "description": "The outputs; with binary outputs, the JSON object then their bytes",
        "content": {"application/octet-stream": _BINARY_BODY},
        "headers": {
            "Inference-Header-Content-Length": {
                "description": "Length of the JSON object when binary tensor data follow it",
                "schema": {"type": "integer"},
            }
        },
    },
    **{code: _ERROR for code in (400, 404, 413, 422, 500, 503, 504)},
}
GENERATE_REQUEST: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": _schema(V2GenerateRequest)}},
    }
}
GENERATE: Responses = {
    200: {"model": V2GenerateResponse, "description": "The completion (not the prompt)"},
    **{code: _ERROR for code in (400, 404, 413, 422, 500, 503, 504)},
}
# Each kind of V2 route (``serving.protocols.v2.http.ROUTE_KINDS``): the GET routes' 200 body
# (the route's response_model) and their other answers; the infer routes' bodies.
ROUTE_DOCS: dict[str, dict[str, Any]] = {
    "server_metadata": {"response_model": V2ServerMetadata, "responses": {}},
    "live": {"response_model": V2LiveResponse, "responses": {}},
    "server_ready": {
        "response_model": V2ReadyResponse,
        "responses": {503: {"model": V2ReadyResponse}},
    },
    "model_metadata": {"response_model": V2ModelMetadata, "responses": {404: _ERROR, 503: _ERROR}},
    "model_ready": {
        "response_model": V2ModelReadyResponse,
        "responses": {404: _ERROR, 503: {"model": V2ModelReadyResponse}},
    },
    "model_config": {"response_model": V2ModelConfig, "responses": {404: _ERROR, 503: _ERROR}},
    "infer": {"responses": INFER, "openapi_extra": INFER_REQUEST},
    "generate": {"responses": GENERATE, "openapi_extra": GENERATE_REQUEST},
}


def _optional_body(properties: dict[str, Any], description: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    content = {"application/json": {"schema": schema}}
    return {"requestBody": {"required": False, "description": description, "content": content}}


_UNLOAD_PARAMETERS = {
    "type": ["object", "null"],
    "properties": {"unload_dependents": {"type": "boolean"}},
    "additionalProperties": False,
}
# The repository extension's routes (``serving.protocols.v2.http_repository.REPOSITORY_KINDS``).
REPOSITORY_DOCS: dict[str, dict[str, Any]] = {
    "repository_index": {
        "response_model": list[V2RepositoryEntry],
        "responses": {400: _ERROR, 413: _ERROR, 503: _ERROR},
        "openapi_extra": _optional_body(
            {"ready": {"type": "boolean"}},
            '{"ready": true}: only the versions ready for inference (default false)',
        ),
        "description": "Every model of the repository and each of its versions: READY, LOADING "
        "or UNAVAILABLE, with the reason.",
    },
    "repository_load": {
        "response_model": V2RepositoryDone,
        "responses": {c: _ERROR for c in (400, 401, 403, 404, 413, 503)},
        "openapi_extra": {
            **_optional_body(
                {"parameters": {"type": ["object", "null"], "additionalProperties": False}},
                "No parameters are taken: a model's settings come from its config.toml",
            ),
            "security": [{"adminToken": []}],
        },
        "description": "Read the model's directory again and serve the versions its policy "
        "selects (and clear an unload's hold against polling); answers once they are loaded.",
    },
    "repository_unload": {
        "response_model": V2RepositoryDone,
        "responses": {c: _ERROR for c in (400, 401, 403, 404, 413, 503)},
        "openapi_extra": {
            **_optional_body(
                {"parameters": _UNLOAD_PARAMETERS},
                "unload_dependents is taken and changes nothing: no model depends on another",
            ),
            "security": [{"adminToken": []}],
        },
        "description": "Stop serving every version of the model: each answers what it holds, "
        "then its processes end. Polling leaves it unloaded until a load.",
    },
}
