"""The OpenAPI document: what each route's bodies and statuses look like, as a contract.

The routes read their bodies with orjson and numpy, not pydantic, so the request schemas are
written by hand: TF-Serving's predict bodies (``tfserving``) and V2's infer body (``v2``)
follow the served model, so that a body the schema accepts is a body the server accepts. The
fixed response bodies are the pydantic models the routes answer through (``bodies``,
``v2_bodies``). ``document`` completes FastAPI's document with the model's bodies.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from serving.openapi import v2 as apidoc_v2
from serving.openapi.tfserving import REF, REQUEST, predict_example, predict_schemas
from shards.signature import ModelSignature

__all__ = ["ADMIN_SECURITY", "Served", "document"]

Schema = dict[str, Any]

_REQUEST_ID_REF = "#/components/headers/X-Request-Id"
_REQUEST_ID_DOC = {
    "description": "The client's X-Request-Id if it is a safe token (up to 128 characters of "
    "A-Za-z0-9._:-), else a generated one; the server's log line for a failed request names it.",
    "required": True,
    "schema": {"type": "string"},
}
ADMIN_SECURITY: dict[str, Any] = {"security": [{"adminToken": []}]}
_ROLLOUT = "/rollout"  # the canary's admin paths: only for the models with one
# A generating model's paths (the generate route, its admin route): only for the models that do.
_GENERATION = ("/generate", "/generation")


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


@dataclass(frozen=True)
class Served:
    """What the document follows: every served (model, version), each model's labels, and the
    signature every served version shares with the most rows a request may hold (``None``
    while one loads, or where they differ: the bodies are then the protocols' generic ones)."""

    versions: tuple[tuple[str, str], ...]
    labels: dict[str, tuple[str, ...]]
    signature: ModelSignature | None
    max_rows: int | None
    rollouts: tuple[str, ...] = ()  # the models with a canary's rollout ([traffic])
    generating: tuple[str, ...] = ()  # the models that generate text (a CausalLM preset)

    def enums(self) -> dict[str, list[str]]:
        """The values of each path parameter (none where nothing is served)."""
        values = {
            "name": sorted({name for name, _ in self.versions}),
            "version": sorted({v for _, v in self.versions}, key=lambda v: (len(v), v)),
            "label": sorted({label for labels in self.labels.values() for label in labels}),
        }
        return {param: listed for param, listed in values.items() if listed}


def document(base: Schema, served: Served) -> Schema:
    """``base`` (FastAPI's document, left unchanged) completed: the predict and V2 infer bodies
    for the served signature (generic while there is none), the served names, versions and
    labels as the only values of ``{name}``, ``{version}`` and ``{label}`` (no ``{label}`` path
    where no label is set; the rollout paths only for models with a rollout), a request of one row
    as the example of each predict and infer body, the admin token's scheme, and
    ``X-Request-Id`` on every response. ``max_rows`` is the most rows a request may hold: fixed
    at start-up, whatever the batch settings become, so the document depends on the served
    versions alone."""
    signature, max_rows = served.signature, served.max_rows
    enums = served.enums()
    doc = copy.deepcopy(base)
    if "label" not in enums:  # no label is set: a path naming one could only answer 404
        paths = doc.get("paths", {})
        for path in [path for path in paths if "{label}" in path]:
            del paths[path]
    for marks, names in (((_ROLLOUT,), served.rollouts), (_GENERATION, served.generating)):
        for path in [path for path in doc.get("paths", {}) if any(m in path for m in marks)]:
            if names:  # a model without a rollout (or that does not generate): only 404
                for operation in doc["paths"][path].values():
                    for parameter in operation.get("parameters", ()):
                        if parameter.get("name") == "name" and parameter.get("in") == "path":
                            parameter["schema"] = {"type": "string", "enum": list(names)}
            else:
                del doc["paths"][path]
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
                listed = enums.get(parameter.get("name", ""))
                # A rollout's and a generating model's names are enumerated above.
                own = _ROLLOUT in path or (
                    parameter.get("name") == "name" and any(m in path for m in _GENERATION)
                )
                if parameter.get("in") == "path" and listed and not own:
                    parameter["schema"] = {"type": "string", "enum": listed}
            for response in operation.get("responses", {}).values():
                response.setdefault("headers", {})["X-Request-Id"] = {"$ref": _REQUEST_ID_REF}
    return doc
