"""TF-Serving's predict bodies as JSON Schema, for the served model: its inputs and outputs
(names, per-row shapes, dtypes) and the rows a request may hold; generic before it is loaded.
Built once per model (``ShardServeApp.openapi`` keeps the document per signature). ``ROUTE_DOCS``:
the documentation of TF Serving's REST routes (``serving.protocols.tfserving.http``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from serving.openapi.bodies import ModelMetadata, ModelStatus, errors, ok
from shards.signature import ModelSignature, TensorSpec

__all__ = [
    "PREDICT_REQUEST", "PREDICT_RESPONSE", "ROUTE_DOCS", "predict_example", "predict_schemas",
]  # fmt: skip

Schema = dict[str, Any]
REF = "#/components/schemas/"
REQUEST, RESPONSE = "PredictRequest", "PredictResponse"
# What the predict routes declare (openapi_extra, responses); ``document`` fills the components.
PREDICT_REQUEST: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": REF + REQUEST}}},
    },
}
PREDICT_RESPONSE = {"$ref": REF + RESPONSE}


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
    description = (
        'Rows ({"instances": [row, ...]}) or columns ({"inputs": ...}) of the '
        "served model's inputs; a row of a model with several inputs is an object keyed by "
        "input name, and every input has the same number of rows."
    )
    if any(None in spec.shape for spec in signature.inputs):
        description += (
            " The model leaves a dimension unknown (? in its shapes, a sequence length): "
            '"instances" may differ in length there, up to the server\'s max_sequence_length, '
            'and each row is answered at its own length; "inputs" (columns) must be '
            "rectangular."
        )
    return {
        "description": description,
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


def predict_schemas(signature: ModelSignature | None, max_rows: int | None) -> dict[str, Schema]:
    """The components the predict routes refer to, for ``signature`` (generic while None)."""
    if signature is None:
        return {REQUEST: _GENERIC_REQUEST, RESPONSE: _GENERIC_RESPONSE}
    return {REQUEST: predict_request(signature, max_rows), RESPONSE: predict_response(signature)}


_PREDICT_DESCRIPTION = (
    "TF-Serving JSON. Header X-Request-Timeout-Ms (a positive number of ms) shortens the "
    "request's deadline. A request is refused from its headers before its body is read when its "
    "Content-Length is over max_body_bytes (413) or the queue is full (503)."
)


_PREDICT_DOC: dict[str, Any] = {
    "openapi_extra": PREDICT_REQUEST,
    "responses": {**ok(PREDICT_RESPONSE), **errors(400, 413, 422, 500, 503, 504)},
    "description": _PREDICT_DESCRIPTION,
}
# What the server hands to ``serving.protocols.tfserving.http.install_tfserving_routes``. Each
# GET returns its declared model (response_model), so that the document cannot drift from the
# bodies: a key the model lacks fails the route (extra="forbid").
ROUTE_DOCS: dict[str, dict[str, Any]] = {
    "predict": _PREDICT_DOC,
    "predict_named": {**_PREDICT_DOC, "responses": {**_PREDICT_DOC["responses"], **errors(404)}},
    "model_status": {
        "response_model": ModelStatus,
        "response_model_exclude_unset": True,  # unset keys are left out
        "responses": errors(404),
    },
    "model_metadata": {"response_model": ModelMetadata, "responses": errors(404, 503)},
}
