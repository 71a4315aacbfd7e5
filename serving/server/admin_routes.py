"""Admin routes: read and change the batch settings of a served version (and a generating
version's run-time knobs: ``/admin/models/{name}[/versions/{version}]/generation``).

``GET /admin/models/{name}[/versions/{version}]/batching`` shows the settings of a model's default
version (or of the version named), ``PUT`` changes some of ``max_batch_size``,
``batch_timeout_ms`` (ms or ``"auto"``), ``max_inflight_batches`` and ``slo_p99_ms``;
``/admin/batching`` is the default model's. The change applies to the next batch; queued rows
stay queued. The routes exist only when ``admin_token`` is set, and then want it as a bearer
token.

A change is held to what the running server can take: the bounds of the same settings, a batch
no larger than the one the memory plan was made for (``max_batch_size`` at start-up), a batch
wait and a latency target below the request deadline. A change outside them is refused (400,
naming the field, the value and the bounds) and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from annotated_types import Le
from fastapi import FastAPI, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model
from pydantic_core import ErrorDetails

from serving.batching.batcher import Batcher
from serving.elastic.limits import operator_sets
from serving.errors import InvalidInputError
from serving.generation.knobs import KNOBS
from serving.http.admin_token import Transport, check_admin_token, check_admin_transport
from serving.http.admission import check_length
from serving.http.json_body import refusal, whole
from serving.http.replies import read_body
from serving.openapi.bodies import (
    BatchingView,
    GenerationChange,
    GenerationView,
    ReplicasView,
    RunTimeView,
    errors,
)
from serving.openapi.document import ADMIN_SECURITY
from serving.quoting import quote
from serving.settings.config import Settings
from serving.settings.waits import AUTO, wait_ceiling

if TYPE_CHECKING:
    from serving.server.state import ServerState
    from serving.version.served import ServedModel

__all__ = [
    "ADMIN_FIELDS",
    "batching_view",
    "change_model",
    "install_admin_routes",
    "policy_changes",
]

ADMIN_FIELDS = ("max_batch_size", "batch_timeout_ms", "max_inflight_batches", "slo_p99_ms")
_BODY_LIMIT = 64 * 1024


def check_token(request: Request, settings: Settings) -> None:
    token, what = settings.admin_token, "admin routes"
    check_admin_transport(token, Transport.of(request.scope), settings.allow_plaintext_admin, what)
    check_admin_token(request.headers.get("authorization"), token, what)


def batching_view(batcher: Batcher, replicas: dict[str, Any] | None = None) -> BatchingView:
    policy = batcher.settings
    return BatchingView(
        max_batch_size=policy.max_batch_size,
        batch_timeout_ms=policy.batch_timeout_ms,
        max_inflight_batches=policy.max_inflight_batches,
        max_queue_rows=policy.max_queue_rows,
        slo_p99_ms=policy.slo_p99_ms,
        effective_wait_ms=batcher.effective_wait_ms,
        queued_rows=batcher.queued_rows,
        inflight_batches=batcher.inflight_batches,
        padding=policy.pad_batches,
        run_time_ms=RunTimeView.model_validate(batcher.run_time_view()),
        replicas=None if replicas is None else ReplicasView.model_validate(replicas),
    )


# ---- the PUT body


def _settings_ceiling(name: str) -> int:
    (ceiling,) = (m.le for m in Settings.model_fields[name].metadata if isinstance(m, Le))
    assert isinstance(ceiling, int), f"Settings.{name} has no integer le bound"
    return ceiling


def _allowed(settings: Settings) -> dict[str, str]:
    """Each field's bounds in words: its description in the document and its refusal's."""
    request_ms = settings.request_timeout_ms
    ceiling, inclusive = wait_ceiling(request_ms)
    wait = f"up to {ceiling:g}" if inclusive else f"below request_timeout_ms ({request_ms:g})"
    return {
        "max_batch_size": f"an integer from 1 to {settings.max_batch_size}, the batch the "
        "memory plan was made for (restart with a larger --max-batch-size for more)",
        "batch_timeout_ms": f"a number of ms from 0, {wait}, or 'auto' (or null) for the "
        "adaptive wait",
        "max_inflight_batches": f"an integer from 1 to {_settings_ceiling('max_inflight_batches')}",
        "slo_p99_ms": f"a number of ms above 0 and up to request_timeout_ms ({request_ms:g}), "
        "or null for none",
    }


def change_model(settings: Settings) -> type[BaseModel]:
    """The PUT body this server takes: every field optional, none unknown, each in bounds."""
    allowed = _allowed(settings)
    request_ms = settings.request_timeout_ms
    ceiling, inclusive = wait_ceiling(request_ms)
    wait_bound: dict[str, Any] = {"le": ceiling} if inclusive else {"lt": ceiling}

    def documented(schema: dict[str, Any]) -> None:
        schema.pop("title", None)
        schema["minProperties"] = 1
        for field in schema["properties"].values():
            # No "default": null beside "type": "integer"; an absent field is left as it is.
            field.pop("default", None)
            field.pop("title", None)

    # Types built at run time (the bounds are this server's): Any to mypy.
    size: Any = Annotated[int, Field(ge=1, le=settings.max_batch_size), BeforeValidator(whole)]
    wait: Any = Annotated[float, Field(ge=0, **wait_bound)] | Literal["auto"] | None
    inflight: Any = Annotated[
        int, Field(ge=1, le=_settings_ceiling("max_inflight_batches")), BeforeValidator(whole)
    ]
    slo: Any = Annotated[float, Field(gt=0, le=request_ms)] | None
    model: type[BaseModel] = create_model(
        "BatchingChange",
        __config__=ConfigDict(
            extra="forbid", strict=True, allow_inf_nan=False, json_schema_extra=documented
        ),
        max_batch_size=(size, Field(None, description=allowed["max_batch_size"])),
        batch_timeout_ms=(wait, Field(None, description=allowed["batch_timeout_ms"])),
        max_inflight_batches=(inflight, Field(None, description=allowed["max_inflight_batches"])),
        slo_p99_ms=(slo, Field(None, description=allowed["slo_p99_ms"])),
    )
    return model


def _refusal(exc: ValidationError, allowed: dict[str, str]) -> InvalidInputError:
    def reason(field: str, error: ErrorDetails) -> str:
        if error["type"] == "extra_forbidden":
            return f"unknown field {quote(field)}; expected some of {list(ADMIN_FIELDS)}"
        return f"{field} must be {allowed[field]}, got {error['input']!r:.80}"

    shape = f"a JSON object with some of {list(ADMIN_FIELDS)}"
    return InvalidInputError(refusal(exc, shape, reason))


def policy_changes(change: BaseModel, batcher: Batcher, settings: Settings) -> dict[str, Any]:
    """The operator's batching fields of a validated body (``serving.elastic.limits``: the
    limits they leave to their defaults, the queue rows, follow from them there)."""
    changes = change.model_dump(exclude_unset=True)
    if "batch_timeout_ms" in changes and changes["batch_timeout_ms"] is None:
        changes["batch_timeout_ms"] = AUTO  # null is the body's other spelling of "auto"
    size = changes.get("max_batch_size", batcher.settings.max_batch_size)
    if settings.allowed_batch_sizes is None:
        changes["allowed_batch_sizes"] = ()
    else:
        changes["allowed_batch_sizes"] = tuple(s for s in settings.allowed_batch_sizes if s <= size)
    return changes


def install_admin_routes(app: FastAPI, settings: Settings) -> None:
    """``/admin/batching`` for the default model, ``/admin/models/{name}/batching`` for a model's
    default version and ``/admin/models/{name}/versions/{version}/batching`` for a version; each
    version's PUT body is held to that version's own settings (its ``config.toml``)."""
    changes: dict[tuple[int, float], tuple[type[BaseModel], dict[str, str]]] = {}

    def change_of(model: ServedModel) -> tuple[type[BaseModel], dict[str, str]]:
        # What bounds a PUT body: the batch the version's memory plan was made for and its
        # request deadline (``_allowed``); built once per pair of them.
        key = (model.settings.max_batch_size, model.settings.request_timeout_ms)
        if key not in changes:
            changes[key] = (change_model(model.settings), _allowed(model.settings))
        return changes[key]

    def model_of(request: Request, name: str | None, version: str | None) -> ServedModel:
        check_token(request, settings)
        state: ServerState = request.app.state.shardserve
        return state.model(name, version)

    async def get_batching(request: Request, name: str | None, version: str | None) -> BatchingView:
        model = model_of(request, name, version)
        return batching_view(model.require_batcher(), model.scaling_parameters())

    async def put_batching(request: Request, name: str | None, version: str | None) -> BatchingView:
        model = model_of(request, name, version)
        batcher = model.require_batcher()
        check_length(request.headers.get("content-length"), _BODY_LIMIT)
        raw = await read_body(request.receive, _BODY_LIMIT, settings.body_read_timeout_s)
        change, allowed = change_of(model)
        try:
            body = change.model_validate_json(raw)
        except ValidationError as exc:
            raise _refusal(exc, allowed) from None
        if not body.model_fields_set:
            raise InvalidInputError(
                f"body must be a non-empty JSON object with some of {list(ADMIN_FIELDS)}"
            )
        try:
            operator_sets(model, policy_changes(body, batcher, model.settings))
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None
        return batching_view(batcher, model.scaling_parameters())

    # FastAPI reads each route's path parameters off its endpoint's signature.
    async def get_default(request: Request) -> BatchingView:
        return await get_batching(request, None, None)

    async def put_default(request: Request) -> BatchingView:
        return await put_batching(request, None, None)

    async def get_named(name: str, request: Request) -> BatchingView:
        return await get_batching(request, name, None)

    async def put_named(name: str, request: Request) -> BatchingView:
        return await put_batching(request, name, None)

    async def get_version(name: str, version: str, request: Request) -> BatchingView:
        return await get_batching(request, name, version)

    async def put_version(name: str, version: str, request: Request) -> BatchingView:
        return await put_batching(request, name, version)

    _install_generation_routes(app, model_of, listed=settings.admin_token is not None)

    # Documented only where they are on; 404 (not listed) where they are off. The document
    # holds the PUT body to the server's settings: a version whose config.toml sets a smaller
    # max_batch_size or request_timeout_ms refuses more, naming its own bound.
    listed = settings.admin_token is not None
    schema = change_model(settings).model_json_schema()
    body_doc = {"required": True, "content": {"application/json": {"schema": schema}}}
    for path, get, put, found in (
        ("/admin/batching", get_default, put_default, ()),
        ("/admin/models/{name}/batching", get_named, put_named, (404,)),
        ("/admin/models/{name}/versions/{version}/batching", get_version, put_version, (404,)),
    ):
        app.add_api_route(
            path,
            get,
            methods=["GET"],
            include_in_schema=listed,
            response_model=BatchingView,
            responses=errors(401, 403, *found, 503),
            openapi_extra=ADMIN_SECURITY,
        )
        app.add_api_route(
            path,
            put,
            methods=["PUT"],
            include_in_schema=listed,
            response_model=BatchingView,
            responses=errors(400, 401, 403, *found, 413, 503),
            openapi_extra={"requestBody": body_doc, **ADMIN_SECURITY},
        )


def _install_generation_routes(
    app: FastAPI,
    model_of: Callable[[Request, str | None, str | None], ServedModel],
    *,
    listed: bool,
) -> None:
    """``/admin/models/{name}[/versions/{version}]/generation``: a generating version's slots
    and run-time knobs; ``PUT`` changes some of ``max_running_sequences`` (1 to its
    ``kv_slots``), ``prefill_timeout_ms`` and ``prefill_budget_tokens`` through their one owner
    (``serving.generation.knobs``), from the next step on."""

    def view(model: ServedModel) -> GenerationView:
        generator = model.require_generator()
        scheduler = generator.scheduler
        knobs = scheduler.knobs
        timeout = knobs.prefill_timeout_ms
        return GenerationView(
            kv_slots=generator.info.kv_slots,
            max_running_sequences=knobs.max_running_sequences,
            prefill_timeout_ms="auto" if timeout is None else timeout,
            prefill_budget_tokens=knobs.prefill_budget_tokens,
            replicas=generator.replicas,
            running_sequences=scheduler.running,
            waiting_prompts=scheduler.waiting,
            free_kv_slots=scheduler.free_slots,
        )

    async def get(request: Request, name: str, version: str | None) -> GenerationView:
        return view(model_of(request, name, version))

    async def put(request: Request, name: str, version: str | None) -> GenerationView:
        model = model_of(request, name, version)
        knobs = model.require_generator().scheduler.knobs
        check_length(request.headers.get("content-length"), _BODY_LIMIT)
        raw = await read_body(request.receive, _BODY_LIMIT, model.settings.body_read_timeout_s)
        shape = f"body must be a JSON object with some of {list(KNOBS)}"
        try:
            change = GenerationChange.model_validate_json(raw)
        except ValidationError as exc:
            raise InvalidInputError(
                f"{shape}: "
                + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            ) from None
        if not change.model_fields_set:
            raise InvalidInputError(f"{shape}; it named none")
        try:
            knobs.change(**change.model_dump(exclude_unset=True))
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None
        return view(model)

    async def get_named(name: str, request: Request) -> GenerationView:
        return await get(request, name, None)

    async def put_named(name: str, request: Request) -> GenerationView:
        return await put(request, name, None)

    async def get_version(name: str, version: str, request: Request) -> GenerationView:
        return await get(request, name, version)

    async def put_version(name: str, version: str, request: Request) -> GenerationView:
        return await put(request, name, version)

    body_doc = {
        "required": True,
        "content": {"application/json": {"schema": GenerationChange.model_json_schema()}},
    }
    for path, get_route, put_route in (
        ("/admin/models/{name}/generation", get_named, put_named),
        ("/admin/models/{name}/versions/{version}/generation", get_version, put_version),
    ):
        app.add_api_route(
            path,
            get_route,
            methods=["GET"],
            include_in_schema=listed,
            response_model=GenerationView,
            responses=errors(400, 401, 403, 404, 503),
            openapi_extra=ADMIN_SECURITY,
        )
        app.add_api_route(
            path,
            put_route,
            methods=["PUT"],
            include_in_schema=listed,
            response_model=GenerationView,
            responses=errors(400, 401, 403, 404, 413, 503),
            openapi_extra={"requestBody": body_doc, **ADMIN_SECURITY},
        )
