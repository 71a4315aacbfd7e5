"""Admin routes of a model's canary (``serving.canary.controller``), behind the admin token like
``/admin/models/{name}/batching``:

- ``GET /admin/models/{name}/rollout``: its stable version and canary, their weights, the state
  (``stable``, ``canary``, ``rolled_back``) and why it was rolled back, and each version's window
  (requests, failure rate, p99);
- ``POST .../rollout/promote``: the canary becomes stable at 100 (the old stable is retired,
  drained: nothing dropped);
- ``POST .../rollout/rollback``: the canary takes no more unversioned requests (it stays
  loaded; ``shardserve_rollbacks_total{reason="manual"}``);
- ``PUT .../rollout/weights`` ``{"stable": 50, "canary": 50}``: a new split.

A model that is not served, or has no ``[traffic]`` in its ``config.toml``: 404 naming the models
that have one; no canary to promote or roll back: 409; bad weights: 400 naming the value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from serving.canary.config import check_weights
from serving.errors import InvalidInputError
from serving.http.admission import check_length
from serving.http.json_body import refusal, whole
from serving.http.replies import read_body
from serving.openapi.bodies import Body, errors
from serving.openapi.document import ADMIN_SECURITY
from serving.quoting import quote
from serving.server.admin_routes import check_token

if TYPE_CHECKING:
    from serving.canary.controller import Rollout
    from serving.repository.manager import Repository
    from serving.settings.config import Settings

__all__ = ["RolloutView", "install_rollout_routes", "rollout_view"]

_BODY_LIMIT = 4 * 1024
_MAX_WEIGHT = 1_000_000


class WindowView(Body):
    """One version's answered requests in the window, of those the split routed: failures are
    those the version caused (5xx, 422), not a 4xx, a full queue or a client's own deadline."""

    requests: int
    failure_rate: float
    p99_ms: float | None


class WeightsView(Body):
    stable: int
    canary: int


class RolloutView(Body):
    model: str
    stable: str
    canary: str | None
    weights: WeightsView
    state: Literal["stable", "canary", "rolled_back"]
    reason: str | None
    promote: Literal["manual", "auto"]
    window_s: float
    versions: dict[str, WindowView]


_Weight = Annotated[int, Field(ge=0, le=_MAX_WEIGHT), BeforeValidator(whole)]


class WeightsChange(BaseModel):
    """The PUT body: both weights, integers >= 0, not both 0."""

    model_config = ConfigDict(extra="forbid", strict=True)

    stable: _Weight = Field(description="the stable version's weight")
    canary: _Weight = Field(description="the canary's weight")


def rollout_view(rollout: Rollout, now: float) -> RolloutView:
    stable, canary = rollout.weights
    rules = rollout.traffic.canary_rules
    versions = {}
    for version, window in sorted(rollout.windows.items()):
        p99 = window.p99_s(now)
        versions[version] = WindowView(
            requests=window.count(now),
            failure_rate=window.failure_rate(now),
            p99_ms=None if p99 is None else p99 * 1000,
        )
    return RolloutView(
        model=rollout.name,
        stable=rollout.stable,
        canary=rollout.canary,
        weights=WeightsView(stable=stable, canary=canary),
        state=rollout.state,
        reason=rollout.reason,
        promote=rules.promote,
        window_s=rules.window_s,
        versions=versions,
    )


def _weights(raw: bytes | bytearray) -> WeightsChange:
    try:
        body = WeightsChange.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidInputError(_refusal(exc)) from None
    try:
        check_weights(body.stable, body.canary)
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None
    return body


def _refusal(exc: ValidationError) -> str:
    def reason(field: str, error: ErrorDetails) -> str:
        if error["type"] == "extra_forbidden":
            return f"unknown field {quote(field)}; expected 'stable' and 'canary'"
        if error["type"] == "missing":
            return f"{field} is missing: give both 'stable' and 'canary'"
        return (
            f"{field} must be an integer weight from 0 to {_MAX_WEIGHT}, got {error['input']!r:.80}"
        )

    shape = 'a JSON object {"stable": <weight>, "canary": <weight>}'
    return refusal(exc, shape, reason)


def install_rollout_routes(app: FastAPI, settings: Settings) -> None:
    """The four routes; in the OpenAPI document only where the admin token is set."""

    def rollout_of(request: Request, name: str) -> Rollout:
        check_token(request, settings)
        repository: Repository = request.app.state.repository  # the lifespan's, before any request
        return repository.rollouts.get(name)

    def view(rollout: Rollout) -> RolloutView:
        return rollout_view(rollout, rollout.now())

    async def get_rollout(name: str, request: Request) -> RolloutView:
        return view(rollout_of(request, name))

    async def promote(name: str, request: Request) -> RolloutView:
        rollout = rollout_of(request, name)
        rollout.promote()
        return view(rollout)

    async def rollback(name: str, request: Request) -> RolloutView:
        rollout = rollout_of(request, name)
        rollout.rollback("manual", "through the admin API")
        return view(rollout)

    async def put_weights(name: str, request: Request) -> RolloutView:
        rollout = rollout_of(request, name)
        check_length(request.headers.get("content-length"), _BODY_LIMIT)
        raw = await read_body(request.receive, _BODY_LIMIT, settings.body_read_timeout_s)
        body = _weights(raw)
        rollout.set_weights(body.stable, body.canary)
        return view(rollout)

    base = "/admin/models/{name}/rollout"
    listed = settings.admin_token is not None
    app.add_api_route(
        base,
        get_rollout,
        methods=["GET"],
        include_in_schema=listed,
        response_model=RolloutView,
        responses=errors(401, 403, 404),
        openapi_extra=ADMIN_SECURITY,
    )
    for action, endpoint in (("promote", promote), ("rollback", rollback)):
        app.add_api_route(
            f"{base}/{action}",
            endpoint,
            methods=["POST"],
            include_in_schema=listed,
            response_model=RolloutView,
            responses=errors(401, 403, 404, 409),
            openapi_extra=ADMIN_SECURITY,
        )
    schema = WeightsChange.model_json_schema()
    body_doc = {"required": True, "content": {"application/json": {"schema": schema}}}
    app.add_api_route(
        f"{base}/weights",
        put_weights,
        methods=["PUT"],
        include_in_schema=listed,
        response_model=RolloutView,
        responses=errors(400, 401, 403, 404, 409, 413),
        openapi_extra={"requestBody": body_doc, **ADMIN_SECURITY},
    )
