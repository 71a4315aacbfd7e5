"""The OpenAPI document: what each route's bodies and statuses look like, as a contract.

The routes read their bodies with orjson and numpy, not pydantic, so the request schemas are
written by hand: TF-Serving's predict bodies (``tfserving``) and V2's infer body (``v2``)
follow the served model, so that a body the schema accepts is a body the server accepts. The
fixed response bodies are the pydantic models the routes answer through (``bodies``,
``v2_bodies``). ``document`` completes FastAPI's document with the model's bodies.
"""

from __future__ import annotations

import copy
from typing import Any

from serving.openapi import v2 as apidoc_v2
from serving.openapi.tfserving import REF, REQUEST, predict_example, predict_schemas
from shards.signature import ModelSignature

__all__ = ["ADMIN_SECURITY", "document"]

Schema = dict[str, Any]

_REQUEST_ID_REF = "#/components/headers/X-Request-Id"
_REQUEST_ID_DOC = {
    "description": "The client's X-Request-Id if it is a safe token (up to 128 characters of "
    "A-Za-z0-9._:-), else a generated one; the server's log line for a failed request names it.",
    "required": True,
    "schema": {"type": "string"},
}
ADMIN_SECURITY: dict[str, Any] = {"security": [{"adminToken": []}]}


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
    schemas.update(predict_schemas(signature, max_rows))
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
            is_predict = json_body and json_body.get("schema", {}).get("$ref") == REF + REQUEST
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
