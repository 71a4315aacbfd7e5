"""Admin routes: read and change the batching policy of a running server.

``GET /admin/batching`` shows the policy, ``PUT /admin/batching`` changes some of
``max_batch_size``, ``batch_timeout_ms`` (ms or ``"auto"``), ``max_inflight_batches`` and
``slo_p99_ms``. The change applies to the next batch; queued rows stay queued. The routes exist
only when ``admin_token`` is set, and then want it as a bearer token.
"""

from __future__ import annotations

import hmac
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response

from serving.apidoc import ADMIN_SECURITY, BATCHING_CHANGE, BatchingView, errors, ok
from serving.batcher import Batcher
from serving.config import Settings, default_queue_rows
from serving.errors import (
    ForbiddenError,
    InvalidInputError,
    NotFoundError,
    UnauthorizedError,
)
from serving.http_io import json_response, read_body
from serving.state import ServerState

__all__ = ["ADMIN_FIELDS", "batching_view", "install_admin_routes", "policy_changes"]

ADMIN_FIELDS = ("max_batch_size", "batch_timeout_ms", "max_inflight_batches", "slo_p99_ms")
_BODY_LIMIT = 64 * 1024


def check_token(request: Request, settings: Settings) -> None:
    expected = settings.admin_token
    if expected is None:
        raise NotFoundError("admin routes are off; start the server with --admin-token to use them")
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise UnauthorizedError(
            "admin routes need the header 'Authorization: Bearer <admin token>'"
        )
    # Constant-time comparison so that the token cannot be guessed byte by byte from timings.
    if not hmac.compare_digest(given.strip().encode(), expected.get_secret_value().encode()):
        raise ForbiddenError("the bearer token does not match the server's admin token")


def batching_view(batcher: Batcher) -> dict[str, Any]:
    policy = batcher.policy
    return {
        "max_batch_size": policy.max_batch_size,
        "batch_timeout_ms": "auto" if policy.is_auto else policy.batch_timeout_ms,
        "max_inflight_batches": policy.max_inflight_batches,
        "max_queue_rows": policy.max_queue_rows,
        "slo_p99_ms": policy.slo_p99_ms,
        "effective_wait_ms": batcher.effective_wait_ms,
        "queued_rows": batcher.queued_rows,
        "inflight_batches": batcher.inflight_batches,
        "padding": policy.pad_batches,
        "run_time_ms": batcher.run_time_view(),
    }


def policy_changes(body: Any, batcher: Batcher, settings: Settings) -> dict[str, Any]:
    """The ``Batcher.reconfigure`` arguments for a PUT body; derived limits follow the new size."""
    if not isinstance(body, dict) or not body:
        raise InvalidInputError(
            f"body must be a non-empty JSON object with some of {list(ADMIN_FIELDS)}, "
            f"got {body!r:.80}"
        )
    unknown = sorted(set(body) - set(ADMIN_FIELDS))
    if unknown:
        raise InvalidInputError(
            f"unknown field(s) {unknown}; expected some of {list(ADMIN_FIELDS)}"
        )
    changes = dict(body)
    for key in ("max_batch_size", "max_inflight_batches"):
        value = changes.get(key)
        if isinstance(value, float) and value.is_integer():  # 8.0 is the integer 8 in JSON
            changes[key] = int(value)
    if "batch_timeout_ms" in changes:
        timeout = changes["batch_timeout_ms"]
        if isinstance(timeout, str):
            if timeout.strip().lower() != "auto":
                raise InvalidInputError(
                    f"batch_timeout_ms must be a number of ms >= 0 or 'auto', got {timeout!r}"
                )
            changes["batch_timeout_ms"] = None
    policy = batcher.policy
    size = changes.get("max_batch_size", policy.max_batch_size)
    inflight = changes.get("max_inflight_batches", policy.max_inflight_batches)
    if isinstance(size, int) and isinstance(inflight, int):
        # Limits the operator left to their defaults scale with the batch, as at start-up.
        if settings.max_queue_rows is None:
            changes["max_queue_rows"] = default_queue_rows(size, inflight)
        if settings.allowed_batch_sizes is None:
            changes["allowed_batch_sizes"] = ()
        else:
            changes["allowed_batch_sizes"] = tuple(
                s for s in settings.allowed_batch_sizes if s <= size
            )
    return changes


def install_admin_routes(app: FastAPI, settings: Settings) -> None:
    def state_of(request: Request) -> ServerState:
        state: ServerState = request.app.state.shardserve
        return state

    async def get_batching(request: Request) -> Response:
        check_token(request, settings)
        return json_response(batching_view(state_of(request).require_batcher()))

    async def put_batching(request: Request) -> Response:
        check_token(request, settings)
        batcher = state_of(request).require_batcher()
        raw = await read_body(request, _BODY_LIMIT)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidInputError(f"body is not valid JSON: {exc}") from None
        try:
            batcher.reconfigure(**policy_changes(body, batcher, settings))
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None
        return json_response(batching_view(batcher))

    # Documented only where they are on; 404 (not listed) where they are off.
    listed = settings.admin_token is not None
    app.add_api_route(
        "/admin/batching",
        get_batching,
        methods=["GET"],
        include_in_schema=listed,
        responses={**ok(BatchingView), **errors(401, 403, 503)},
        openapi_extra=ADMIN_SECURITY,
    )
    app.add_api_route(
        "/admin/batching",
        put_batching,
        methods=["PUT"],
        include_in_schema=listed,
        responses={**ok(BatchingView), **errors(400, 401, 403, 413, 503)},
        openapi_extra=BATCHING_CHANGE,
    )
