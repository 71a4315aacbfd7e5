"""The V2 infer request as the served model takes it, for the OpenAPI document.

The protocol's own request schema (``serving.openapi.v2_bodies``) admits every model's inputs; once
the model is loaded, ``infer_request`` narrows it to this model's: the input names, datatypes
and per-row dimensions, and data that holds exactly as many values as the shape says. JSON
Schema cannot multiply, so that last rule is spelt out for each row count, from 1 to
``LISTED_ROWS`` at most, whatever the batch: a request may hold more rows (up to
``max_queue_rows``), and a document that listed them all would grow with the batch (one schema
per row count, 4,096 of them at ``--max-batch-size 4096``).

The binary tensor extension (``Inference-Header-Content-Length`` and the bytes after the JSON)
is described in words there: no schema can say that a header gives the length of a body's first
part, and a generator drawing bodies from one would send mostly unreadable ones.
"""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

from serving.protocols.v2.datatypes import BINARY_ONLY
from serving.protocols.v2.tensors import spec_datatype
from shards.signature import ModelSignature, TensorSpec

__all__ = ["BINARY_EXTENSION", "LISTED_ROWS", "infer_example", "infer_request"]

Schema = dict[str, Any]

BINARY_EXTENSION = (
    "Binary tensor data extension: an input with parameters.binary_data_size carries no "
    '"data"; its raw little-endian bytes follow the JSON object, in input order, and the '
    "Inference-Header-Content-Length header gives the JSON object's length in bytes "
    "(Content-Type application/octet-stream). An output asked for with "
    'parameters.binary_data (or "binary_data_output" in the request\'s parameters) comes back '
    "the same way."
)
_PARAMETERS = {"type": ["object", "null"]}
LISTED_ROWS = 8


def _value(datatype: str, spec: TensorSpec) -> Schema:
    kind = spec.np_dtype.kind
    if datatype == "BOOL":
        return {"type": "boolean"}
    if kind in "iu":
        info = np.iinfo(spec.np_dtype)
        return {"type": "integer", "minimum": int(info.min), "maximum": int(info.max)}
    return {"type": "number"}


def _data(rows: int, spec: TensorSpec, value: Schema) -> Schema:
    """``rows`` rows of ``spec`` as flat data, or nested as the shape is."""
    dims = [rows, *(d for d in spec.shape if d is not None)]
    nested = value
    for dim in reversed(dims):
        nested = {"type": "array", "items": nested, "minItems": dim, "maxItems": dim}
    count = prod(dims)
    flat = {"type": "array", "items": value, "minItems": count, "maxItems": count}
    return flat if flat == nested else {"anyOf": [flat, nested]}


def _input(spec: TensorSpec, rows: int) -> Schema:
    datatype = spec_datatype(spec)
    return {
        "type": "object",
        "required": ["name", "shape", "datatype", "data"],
        "properties": {
            "name": {"const": spec.name},
            "shape": {"const": [rows, *spec.shape]},
            "datatype": {"const": datatype},
            "data": _data(rows, spec, _value(datatype, spec)),
            # JSON data only: binary_data_size would say that bytes follow the JSON object.
            "parameters": {**_PARAMETERS, "properties": {"binary_data_size": False}},
        },
    }


def _outputs(signature: ModelSignature) -> Schema:
    asked = {
        "type": ["object", "null"],
        "properties": {"binary_data": {"type": "boolean"}},
    }
    return {
        "type": ["array", "null"],
        "description": "Outputs to return (all when absent, null or empty); each at most once",
        "prefixItems": [
            {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"const": spec.name}, "parameters": asked},
            }
            for spec in signature.outputs
        ],
        "maxItems": len(signature.outputs),
    }


def infer_request(signature: ModelSignature, max_rows: int) -> Schema | None:
    """The JSON request body of up to ``max_rows`` rows (the schema lists ``LISTED_ROWS`` at
    most), or None where it cannot be written (an input of free dimensions or a binary-only
    datatype)."""
    if any(None in spec.shape or spec_datatype(spec) in BINARY_ONLY for spec in signature.inputs):
        return None
    listed = min(max_rows, LISTED_ROWS)
    by_rows = [
        {
            "properties": {
                "inputs": {
                    "prefixItems": [_input(spec, rows) for spec in signature.inputs],
                    "minItems": len(signature.inputs),
                    "maxItems": len(signature.inputs),
                }
            }
        }
        for rows in range(1, listed + 1)
    ]
    return {
        "type": "object",
        "required": ["inputs"],
        "description": f"The model's inputs, in this order, each of shape [rows, ...] with "
        f"rows x (its row size) values in data (flat or nested); the schema lists 1 to "
        f"{listed} rows, a request may hold up to {max_rows}. {BINARY_EXTENSION}",
        "properties": {
            "id": {"type": ["string", "null"]},
            "parameters": {
                **_PARAMETERS,
                "properties": {"binary_data_output": {"type": "boolean"}},
            },
            "inputs": {"type": "array"},
            "outputs": _outputs(signature),
        },
        "anyOf": by_rows,
    }


def infer_example(signature: ModelSignature) -> Schema | None:
    """A request of one row of zeros; None where an input is binary-only (BF16)."""
    inputs = []
    for spec in signature.inputs:
        datatype = spec_datatype(spec)
        if datatype in BINARY_ONLY:
            return None
        shape = [1, *(1 if dim is None else dim for dim in spec.shape)]
        zero = False if datatype == "BOOL" else 0
        inputs.append(
            {"name": spec.name, "shape": shape, "datatype": datatype, "data": [zero] * prod(shape)}
        )
    return {"inputs": inputs}
