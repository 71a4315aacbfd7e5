"""The OpenAPI document: what each route's bodies and statuses look like, as a contract.

The routes read their bodies with orjson and numpy, not pydantic, so the body schemas are
written here. Those of the predict routes follow the served model: once it is loaded,
``document`` fills in its inputs and outputs (names, per-row shapes, dtypes), the rows a request
may hold and the one model name served, so that a body the schema accepts is a body the server
accepts. Before the model is loaded they are generic.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from serving.openapi import v2 as apidoc_v2
from shards.signature import ModelSignature, TensorSpec

__all__ = [
    "ADMIN_SECURITY",
    "PREDICT_REQUEST",
    "PREDICT_RESPONSE",
    "document",
    "errors",
    "ok",
]

Schema = dict[str, Any]
Responses = dict[int | str, dict[str, Any]]

_REF = "#/components/schemas/"
_REQUEST_ID_REF = "#/components/headers/X-Request-Id"
_REQUEST_ID_DOC = {
    "description": "The client's X-Request-Id if it is a safe token (up to 128 characters of "
    "A-Za-z0-9._:-), else a generated one; the server's log line for a failed request names it.",
    "required": True,
    "schema": {"type": "string"},
}
_RETRY_AFTER_DOC = {
    "description": "Seconds to wait before retrying (when the queue is full).",
    "schema": {"type": "integer", "minimum": 1},
}
_WHY = {
    400: "The body or a header does not fit the model signature (the message says what was "
    "sent and what is expected).",
    401: "No bearer token.",
    403: "The bearer token is not the admin token.",
    404: "No such model (the message names the one served).",
    413: "The body is over max_body_bytes.",
    422: "The model raised on this request's rows; its batch-mates got their answers.",
    500: "The model or its stage processes failed on the batch.",
    503: "The queue is full (with Retry-After), the model is loading or has no healthy "
    "replica, or the server is stopping.",
    504: "The deadline passed before the rows were computed.",
}


class Body(BaseModel):
    """A response body: a key the model lacks fails the route that sends it (a test finds that
    before the document drifts from what is sent)."""

    model_config = ConfigDict(extra="forbid")


class Error(Body):
    error: str


def ok(schema: Schema | type[BaseModel], description: str = "OK") -> Responses:
    """The 200 response of a route with a JSON body of ``schema`` (a model or a raw schema)."""
    if isinstance(schema, dict):
        return {
            200: {"description": description, "content": {"application/json": {"schema": schema}}}
        }
    return {200: {"description": description, "model": schema}}


def errors(*codes: int) -> Responses:
    docs: Responses = {}
    for code in codes:
        docs[code] = {"description": _WHY[code], "model": Error}
        if code == 503:
            docs[code]["headers"] = {"Retry-After": _RETRY_AFTER_DOC}
    return docs


PREDICT_REQUEST: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": _REF + "PredictRequest"}}},
    },
}
ADMIN_SECURITY: dict[str, Any] = {"security": [{"adminToken": []}]}
PREDICT_RESPONSE = {"$ref": _REF + "PredictResponse"}

# ---- fixed bodies


class Alive(Body):
    status: Literal["alive"]


class Readiness(Body):
    status: Literal["ready", "loading", "failed", "shutting down", "unavailable"]
    model: str | None = None
    error: str | None = None


class VersionState(Body):
    error_code: Literal["OK", "UNAVAILABLE"]
    error_message: str


class ModelVersion(Body):
    version: str
    state: Literal["AVAILABLE", "LOADING", "FAILED"]
    status: VersionState


class Replicas(Body):
    total: int
    healthy: int


class ModelStatus(Body):
    model_version_status: list[ModelVersion]
    replicas: Replicas | None = None


class TensorDoc(Body):
    name: str
    shape: list[int | None]
    dtype: str


class ModelSpec(Body):
    name: str
    version: str


class ModelMetadata(Body):
    model_spec: ModelSpec
    name: str
    inputs: list[TensorDoc]
    outputs: list[TensorDoc]
    num_stages: int
    replicas: int
    max_batch_size: int


class RunTimeView(Body):
    """What the batching policy predicts per batch size (ms; null: nothing measured yet)."""

    from_compute: bool
    hop: float | None
    latency: dict[str, float | None]
    bottleneck: dict[str, float | None]


class BatchingView(Body):
    max_batch_size: int
    batch_timeout_ms: float | Literal["auto"]
    max_inflight_batches: int
    max_queue_rows: int
    slo_p99_ms: float | None
    effective_wait_ms: float
    queued_rows: int
    inflight_batches: int
    padding: bool
    run_time_ms: RunTimeView


# ---- the bodies of the predict routes


def _value(dtype: np.dtype[Any], *, output: bool) -> Schema:
    if dtype.kind == "b":
        return {"type": "boolean"}
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return {"type": "integer", "minimum": int(info.min), "maximum": int(info.max)}
    if output:  # orjson writes inf and nan as null
        return {"type": ["number", "null"]}
    return {"type": "number"}


def _row(spec: TensorSpec, *, output: bool = False) -> Schema:
    schema = _value(spec.np_dtype, output=output)
    for dim in reversed(spec.shape):
        schema = {"type": "array", "items": schema}
        if dim is not None:
            schema.update(minItems=dim, maxItems=dim)
    return schema


def _rows(item: Schema, max_rows: int | None) -> Schema:
    schema: Schema = {"type": "array", "minItems": 1, "items": item}
    if max_rows is not None:
        schema["maxItems"] = max_rows
    return schema


def _keyed(schemas: dict[str, Schema]) -> Schema:
    return {
        "type": "object",
        "properties": schemas,
        "required": list(schemas),
        "additionalProperties": False,
    }


def _body(key: str, value: Schema) -> Schema:
    properties: Schema = {key: value}
    if key in ("instances", "inputs"):
        properties["signature_name"] = {"description": "accepted and ignored (TF-Serving)"}
    return {
        "type": "object",
        "properties": properties,
        "required": [key],
        "additionalProperties": False,
    }


def predict_request(signature: ModelSignature, max_rows: int | None) -> Schema:
    rows = {spec.name: _row(spec) for spec in signature.inputs}
    columns = _keyed({name: _rows(row, max_rows) for name, row in rows.items()})
    instances = [_rows(_keyed(rows), max_rows)]
    if len(rows) == 1:
        (row,) = rows.values()
        instances.insert(0, _rows(row, max_rows))
        columns = {"anyOf": [_rows(row, max_rows), columns]}
    return {
        "description": 'Rows ({"instances": [row, ...]}) or columns ({"inputs": ...}) of the '
        "served model's inputs; a row of a model with several inputs is an object keyed by "
        "input name, and every input has the same number of rows.",
        "anyOf": [_body("instances", {"anyOf": instances}), _body("inputs", columns)],
    }


def predict_response(signature: ModelSignature) -> Schema:
    rows = {spec.name: _row(spec, output=True) for spec in signature.outputs}
    if len(rows) == 1:
        (row,) = rows.values()
        predictions = outputs = _rows(row, None)
    else:
        predictions = _rows(_keyed(rows), None)
        outputs = _keyed({name: _rows(row, None) for name, row in rows.items()})
    return {
        "description": '"predictions" (rows) answers "instances", "outputs" (columns) answers '
        '"inputs"; null stands for an output value that is not finite.',
        "anyOf": [_body("predictions", predictions), _body("outputs", outputs)],
    }


_ANY_ROWS = {"type": "array", "minItems": 1, "items": {}}
_GENERIC_REQUEST: Schema = {
    "description": "The model is still loading: its inputs are documented once it is loaded.",
    "anyOf": [
        _body("instances", _ANY_ROWS),
        _body("inputs", {"anyOf": [_ANY_ROWS, {"type": "object"}]}),
    ],
}
_GENERIC_RESPONSE: Schema = {
    "anyOf": [_body("predictions", _ANY_ROWS), _body("outputs", {"type": ["array", "object"]})]
}


def _zeros(spec: TensorSpec) -> Any:
    value: Any = False if spec.np_dtype.kind == "b" else 0
    for dim in reversed(spec.shape):
        value = [value] * (1 if dim is None else dim)
    return value


def predict_example(signature: ModelSignature) -> Schema:
    """A request of one row of zeros."""
    if len(signature.inputs) == 1:
        return {"instances": [_zeros(signature.inputs[0])]}
    return {"instances": [{spec.name: _zeros(spec) for spec in signature.inputs}]}


def _is_v2_infer(path: str) -> bool:
    return path.startswith("/v2/models/") and path.endswith("/infer")


def _v2_infer(operation: Schema, signature: ModelSignature, max_rows: int) -> None:
    body = apidoc_v2.infer_request(signature, max_rows)
    if body is None:
        return
    example = apidoc_v2.infer_example(signature)
    content: Schema = {"schema": body, **({"example": example} if example else {})}
    operation["requestBody"] = {"required": True, "content": {"application/json": content}}
    operation["parameters"] = [
        p for p in operation.get("parameters", ()) if p.get("in") != "header"
    ]


def document(
    base: Schema,
    signature: ModelSignature | None,
    served: str,
    max_rows: int | None,
) -> Schema:
    """``base`` (FastAPI's document, left unchanged) completed: the predict and V2 infer bodies
    for ``signature`` (generic while it is None), the served model's name and version as the
    only values of ``{name}`` and ``{version}``, a request of one row as the example of each
    predict and infer body, the admin token's scheme, and ``X-Request-Id`` on every response.
    ``max_rows`` is the most rows a request may hold: fixed at start-up, whatever the batching
    policy becomes, so the document depends on the model alone."""
    doc = copy.deepcopy(base)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    if signature is None:
        schemas["PredictRequest"] = _GENERIC_REQUEST
        schemas["PredictResponse"] = _GENERIC_RESPONSE
    else:
        schemas["PredictRequest"] = predict_request(signature, max_rows)
        schemas["PredictResponse"] = predict_response(signature)
    components.setdefault("headers", {})["X-Request-Id"] = _REQUEST_ID_DOC
    components.setdefault("securitySchemes", {})["adminToken"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "the server's --admin-token",
    }
    for path, operations in doc.get("paths", {}).items():
        for operation in operations.values():
            if signature is not None and max_rows is not None and _is_v2_infer(path):
                _v2_infer(operation, signature, max_rows)
            json_body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            is_predict = (
                json_body and json_body.get("schema", {}).get("$ref") == _REF + "PredictRequest"
            )
            if signature is not None and is_predict:
                json_body["example"] = predict_example(signature)
            for parameter in operation.get("parameters", ()):
                if parameter.get("in") != "path":
                    continue
                if parameter.get("name") == "name":
                    parameter["schema"] = {"type": "string", "enum": [served]}
                elif parameter.get("name") == "version":  # one version is served: "1"
                    parameter["schema"] = {"type": "string", "enum": ["1"]}
            for response in operation.get("responses", {}).values():
                response.setdefault("headers", {})["X-Request-Id"] = {"$ref": _REQUEST_ID_REF}
    return doc
