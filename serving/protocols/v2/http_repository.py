"""The model repository extension (KServe V2 / Triton) over HTTP, answered by the server's
``RepositoryControl`` (``serving.protocols.contract``; gRPC's ``RepositoryIndex`` and the rest
call the same one):

    POST /v2/repository/index                  [{"name", "version", "state", "reason"}, ...]
    POST /v2/repository/models/{m}/load        reads the model's directory again, serves it
    POST /v2/repository/models/{m}/unload      drains and ends every version of the model

The index's body is optional (``{"ready": true}``: only versions ready for inference); load and
unload take an optional ``{"parameters": {...}}`` and want the admin token, as the admin routes
do (``serving.http.admin_token``: off without ``--admin-token``). A parameter shardserve does
not take is a 400 naming it: a model's settings come from its ``config.toml``, never from a
request. Errors are ``{"error": ...}``, as Triton's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request

from serving.errors import InvalidInputError, NotReadyError
from serving.http.admin_token import Transport, check_admin_token, check_admin_transport
from serving.http.admission import check_length
from serving.http.replies import read_body
from serving.protocols.contract import RepositoryControl
from serving.quoting import quote

if TYPE_CHECKING:
    from pydantic import SecretStr

__all__ = ["REPOSITORY_KINDS", "install_repository_routes", "parse_body"]

REPOSITORY_KINDS = ("repository_index", "repository_load", "repository_unload")
_BODY_LIMIT = 64 * 1024
_WHAT = "repository load and unload"
# tritonclient's unload_model always sends it; no model here depends on another, so either
# value unloads exactly the model named.
_UNLOAD_PARAMETERS = {"unload_dependents": bool}
NO_REPOSITORY = "the model repository is not running (the server is starting or stopping); retry"


def parse_body(raw: bytes | bytearray, fields: Mapping[str, tuple[type, ...]]) -> dict[str, Any]:
    """An optional JSON object body of some of ``fields`` (name -> the types it may hold);
    empty: ``{}``. Anything else is a 400 naming what was wrong."""
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidInputError(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidInputError(
            f"body must be a JSON object with some of {list(fields)}, got {bytes(raw[:80])!r}"
        )
    for key, value in body.items():
        if key not in fields:
            raise InvalidInputError(f"unknown field {quote(key)}; expected some of {list(fields)}")
        types = fields[key]
        # JSON's true is not a number here, nor 1 a boolean.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            kinds = " or ".join(_JSON_TYPE[t] for t in types)
            raise InvalidInputError(f"field {key!r} must be {kinds}, got {value!r:.80}")
    return body


_JSON_TYPE = {bool: "a boolean", dict: "an object", type(None): "null"}
_PARAMETERS = {"parameters": (dict, type(None))}


def _parameters(body: dict[str, Any], taken: Mapping[str, type], action: str) -> None:
    for key, value in (body.get("parameters") or {}).items():
        kind = taken.get(key)
        if kind is None:
            offered = f"it takes {list(taken)}" if taken else "it takes none"
            raise InvalidInputError(
                f"{action} parameter {quote(key)} is not taken ({offered}); a model's settings "
                "come from its config.toml in the repository"
            )
        if not isinstance(value, kind):
            raise InvalidInputError(
                f"{action} parameter {quote(key)} must be a boolean, got {quote(value)}"
            )


def _repository(request: Request) -> RepositoryControl:
    control: RepositoryControl | None = getattr(request.app.state.shardserve, "repository", None)
    if control is None:
        raise NotReadyError(NO_REPOSITORY)
    return control


def install_repository_routes(
    app: FastAPI,
    admin_token: SecretStr | None,
    docs: Mapping[str, Mapping[str, Any]],
    *,
    body_timeout_s: float,
    allow_plaintext_admin: bool = False,
) -> None:
    """The routes above, each documented with ``docs[kind]`` (a kind of ``REPOSITORY_KINDS``);
    load and unload are listed in the document only where the admin token turns them on; a
    body must arrive within ``body_timeout_s`` (``body_read_timeout_s``); the token over clear
    text from another machine only with ``allow_plaintext_admin``."""

    def _check_token(request: Request) -> None:
        transport = Transport.of(request.scope)
        check_admin_transport(admin_token, transport, allow_plaintext_admin, _WHAT)
        check_admin_token(request.headers.get("authorization"), admin_token, _WHAT)

    async def _body(request: Request) -> bytes | bytearray:
        check_length(request.headers.get("content-length"), _BODY_LIMIT)
        return await read_body(request.receive, _BODY_LIMIT, body_timeout_s)

    async def index(request: Request) -> list[dict[str, Any]]:
        body = parse_body(await _body(request), {"ready": (bool,)})
        entries = _repository(request).index(ready_only=body.get("ready", False))
        # Triton's "version" is optional: left out for a model with no complete version.
        return [{k: v for k, v in entry.items() if k != "version" or v} for entry in entries]

    # Done: an empty object (Triton's body is empty; its clients read only the status).
    async def load(name: str, request: Request) -> dict[str, Any]:
        _check_token(request)
        _parameters(parse_body(await _body(request), _PARAMETERS), {}, "load")
        await _repository(request).load(name)
        return {}

    async def unload(name: str, request: Request) -> dict[str, Any]:
        _check_token(request)
        body = parse_body(await _body(request), _PARAMETERS)
        _parameters(body, _UNLOAD_PARAMETERS, "unload")
        await _repository(request).unload(name)
        return {}

    listed = admin_token is not None
    app.add_api_route(
        "/v2/repository/index", index, methods=["POST"], tags=["v2"], **docs["repository_index"]
    )
    for action, endpoint in (("load", load), ("unload", unload)):
        app.add_api_route(
            f"/v2/repository/models/{{name}}/{action}",
            endpoint,
            methods=["POST"],
            tags=["v2"],
            include_in_schema=listed,
            **docs[f"repository_{action}"],
        )
