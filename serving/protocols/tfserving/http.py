"""TF Serving's REST routes for every served model: predict (declared here, answered by the fast
path), model status and metadata, each for the model's default version, a version
(``/versions/{v}``) or a label (``/labels/{l}``).

    POST /predict                                          the default model
    POST /v1/models/{m}[/versions/{v}|/labels/{l}]:predict
    GET  /v1/models/{m}[/versions/{v}|/labels/{l}]          model_version_status
    GET  /v1/models/{m}[/versions/{v}|/labels/{l}]/metadata

``GET /v1/models/{m}`` lists every version of the model, as TF Serving does; a version or label
lists that one. An unknown model, version or label is a 404 naming what is served
(``ServerState.model``). The routes' documentation and response models are
``serving.openapi.tfserving``'s ``ROUTE_DOCS``, handed in by the server (a layer above this one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request, Response
from starlette.convertors import Convertor, register_url_convertor

from serving.errors import NotReadyError
from serving.http.fast import ModelRef, RawAnswer, RawHandler
from serving.protocols.contract import ModelHandle
from serving.protocols.tfserving.status import tfserving_status

if TYPE_CHECKING:
    from serving.batching.settings import BatchSettings
    from shards.pipeline.health import Health
    from shards.signature import ModelSignature

__all__ = ["ROUTE_KINDS", "RouteDocs", "install_tfserving_routes", "version_status"]

# What each kind of route is documented with: keyword arguments of ``add_api_route``
# (``response_model``, ``responses``, ``openapi_extra``, ``description``), given by the server
# from ``serving.openapi.tfserving``.
RouteDocs = Mapping[str, Mapping[str, Any]]
ROUTE_KINDS = ("predict", "predict_named", "model_status", "model_metadata")


class _Segment(Convertor[str]):
    """A {name}, {version} or {label} of a GET route: not one that ends in ``:predict``, which
    is the POST route's (so that its 405 names only POST)."""

    regex = r"[^/]+(?<!:predict)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("model_status", _Segment())

# The three ways a path names a version: (path suffix, its ModelRef's fields).
_SELECTORS = ("", "/versions/{version:model_status}", "/labels/{label:model_status}")


class _Runner(Protocol):
    """What the metadata route reads of a version's runner (``serving.version.runner``)."""

    @property
    def signature(self) -> ModelSignature: ...

    @property
    def num_stages(self) -> int: ...

    @property
    def replicas(self) -> int: ...


class ServedModel(ModelHandle, Protocol):
    """A served version as these routes read it (``serving.version.served.ServedModel``, a
    Protocol: the protocols import nothing of a version's runner, Ray or TensorFlow)."""

    @property
    def runner(self) -> _Runner | None: ...

    @property
    def batch_settings(self) -> BatchSettings | None: ...

    def health(self) -> Health | None: ...


class _Served(Protocol):
    """What the routes read of the server's state (``serving.server.state.ServerState``): its
    versions, served models in full (their health, runner and batch settings)."""

    def served(self) -> list[ServedModel]: ...

    def model(
        self,
        name: str | None = None,
        version: str | None = None,
        label: str | None = None,
        *,
        split: bool = True,
    ) -> ServedModel: ...


def _state(request: Request) -> _Served:
    state: _Served = request.app.state.shardserve
    return state


def _served(request: Request, ref: ModelRef) -> ServedModel:
    # Status and metadata are looks: they take no turn of a canary's split.
    return _state(request).model(ref.name, ref.version, ref.label, split=False)


def version_status(model: ServedModel) -> dict[str, Any]:
    """One entry of ``model_version_status``: TF Serving's state of one served version
    (``serving.protocols.tfserving.status``: a failed load reads END with its error)."""
    health = model.health()
    status = tfserving_status(model)
    entry: dict[str, Any] = {
        "version": model.version,
        "state": status.state,
        "status": {"error_code": status.error_code, "error_message": status.message},
    }
    if health is not None:
        entry["replicas"] = {"total": health.replicas, "healthy": health.healthy}
    return entry


def install_tfserving_routes(app: FastAPI, docs: RouteDocs, predict_model: RawHandler) -> None:
    """The routes above; ``predict_model`` answers predict (the fast path answers it before the
    router where it can: these declare it for the OpenAPI document); ``docs``: each kind's
    documentation (``ROUTE_KINDS``)."""

    async def predict(request: Request) -> Response:
        return RawAnswer(predict_model, ModelRef(None))

    async def predict_named(name: str, request: Request) -> Response:
        return RawAnswer(predict_model, ModelRef(name))

    async def predict_version(name: str, version: str, request: Request) -> Response:
        return RawAnswer(predict_model, ModelRef(name, version))

    async def predict_label(name: str, label: str, request: Request) -> Response:
        return RawAnswer(predict_model, ModelRef(name, label=label))

    app.add_api_route("/predict", predict, methods=["POST"], **docs["predict"])
    for suffix, endpoint in (
        ("", predict_named),
        ("/versions/{version}", predict_version),
        ("/labels/{label}", predict_label),
    ):
        path = f"/v1/models/{{name}}{suffix}:predict"
        app.add_api_route(path, endpoint, methods=["POST"], **docs["predict_named"])

    # Each GET returns its declared model (``docs``' response_model).
    async def model_status(
        name: str, request: Request, version: str | None = None, label: str | None = None
    ) -> dict[str, Any]:
        state = _state(request)
        default = _served(request, ModelRef(name, version, label))
        if version is None and label is None:  # TF Serving lists every version of the model
            versions = [served for served in state.served() if served.name == name]
        else:
            versions = [default]
        body: dict[str, Any] = {"model_version_status": [version_status(v) for v in versions]}
        health = default.health()
        if health is not None:  # the version a request without one reaches
            body["replicas"] = {"total": health.replicas, "healthy": health.healthy}
        return body

    async def model_metadata(
        name: str, request: Request, version: str | None = None, label: str | None = None
    ) -> dict[str, Any]:
        model = _served(request, ModelRef(name, version, label))
        runner = model.runner
        if runner is None:
            raise NotReadyError(
                f"model {model.name!r} version {model.version} is still loading; its signature "
                "is not known yet"
            )
        batching = model.batch_settings
        max_batch = batching.max_batch_size if batching else model.settings.max_batch_size
        return {
            "model_spec": {"name": model.name, "version": model.version},
            **runner.signature.to_json(),
            "name": model.name,
            "num_stages": runner.num_stages,
            "replicas": runner.replicas,
            "max_batch_size": max_batch,
        }

    for suffix in _SELECTORS:
        app.add_api_route(
            f"/v1/models/{{name:model_status}}{suffix}",
            _selected(model_status, suffix),
            methods=["GET"],
            **docs["model_status"],
        )
        app.add_api_route(
            f"/v1/models/{{name}}{suffix}/metadata",
            _selected(model_metadata, suffix),
            methods=["GET"],
            **docs["model_metadata"],
        )


def _selected(endpoint: Any, suffix: str) -> Any:
    """``endpoint`` with the path parameters of ``suffix`` in its signature (FastAPI reads
    them off it)."""
    if "{version" in suffix:

        async def by_version(name: str, version: str, request: Request) -> dict[str, Any]:
            result: dict[str, Any] = await endpoint(name, request, version=version)
            return result

        return by_version
    if "{label" in suffix:

        async def by_label(name: str, label: str, request: Request) -> dict[str, Any]:
            result: dict[str, Any] = await endpoint(name, request, label=label)
            return result

        return by_label

    async def by_name(name: str, request: Request) -> dict[str, Any]:
        result: dict[str, Any] = await endpoint(name, request)
        return result

    return by_name
