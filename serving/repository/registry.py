"""The server's registry: what it serves, as data. The versions by model name and version
(``serving.version.served``), the labels that point at them, each model's split of unversioned
requests (``traffic``: a canary's weights, or a replica-by-replica switch's split by healthy
replicas), and why a model the repository knows is not served.

It holds no manager: the reconciler (``serving.repository.reconciler``) and the canary
controller write into it, the routes read it; the routing pick is ``model()`` over this data
(``serving.repository.routing.route``). The process's stop (its budget, the drain) is the
server's (``serving.server.state``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serving.errors import InvalidInputError, NotFoundError, NotReadyError
from serving.metrics.series import Metrics
from serving.quoting import quote
from serving.repository.routing import Traffic, route, version_key
from serving.settings.config import Settings

if TYPE_CHECKING:
    from serving.version.served import ServedModel

__all__ = ["NO_MODEL", "Registry"]

NO_MODEL = "no model is served yet; retry when GET /readyz answers 200"


@dataclass
class Registry:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    # name -> version -> the served version (a failed load stays, with its reason, until unload)
    models: dict[str, dict[str, ServedModel]] = field(default_factory=dict)
    # name -> label -> version; a label points only at a READY version (the reconciler sees to it)
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    default_model: str | None = None  # /predict's model; None: the only one served
    # name -> how its requests that name no version split between two versions: a canary's
    # (a model whose config.toml has [traffic]) or a version switch replica by replica's
    traffic: dict[str, Traffic] = field(default_factory=dict)
    # Why a model the repository knows is not served (unloaded through the API): the 404 says it.
    unserved: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.default_model is None:
            self.default_model = self.settings.default_model

    @property
    def accepting(self) -> bool:
        """The server takes new requests (the server's state says when it stops)."""
        return True

    def add_model(self, model: ServedModel) -> None:
        versions = self.models.setdefault(model.name, {})
        if model.version in versions:
            raise ValueError(
                f"model {model.name!r} version {model.version!r} is served already; "
                "give each a unique name and version"
            )
        versions[model.version] = model
        self.unserved.pop(model.name, None)

    def remove_model(self, name: str, version: str) -> ServedModel | None:
        """Stop routing to that version (the caller has drained and closed it)."""
        versions = self.models.get(name, {})
        removed = versions.pop(version, None)
        if not versions:
            self.models.pop(name, None)
        labels = self.labels.get(name, {})
        for label in [label for label, v in labels.items() if v == version]:
            del labels[label]
        if not labels:
            self.labels.pop(name, None)
        return removed

    def versions(self, name: str) -> list[str]:
        """The versions of ``name`` served now, oldest first."""
        return sorted(self.models.get(name, {}), key=int)

    def served(self) -> list[ServedModel]:
        """Every served version, by model name then version."""
        return [
            versions[v]
            for name, versions in sorted(self.models.items())
            for v in sorted(versions, key=version_key)
        ]

    def model(
        self,
        name: str | None = None,
        version: str | None = None,
        label: str | None = None,
        *,
        split: bool = True,
    ) -> ServedModel:
        """The version ``version`` (or the one ``label`` points at) of the model ``name``;
        without a name the default model (``/predict``'s), without a version or label the one
        its rollout picks (its stable or canary, by weight; during a switch replica by replica,
        the old or the new by healthy replicas) if that serves, else its highest READY version,
        else its highest. ``split=False`` looks without taking a turn of the
        split (a look before the request's own)."""
        if version is not None and label is not None:
            raise InvalidInputError(
                f"name a version ({quote(version)}) or a label ({quote(label)}) of the model, "
                "not both"
            )
        found_name = self._name(name)
        versions = self.models.get(found_name)
        if versions is None:
            raise NotFoundError(self._no_model(found_name, default=name is None))
        if label is not None:
            version = self._labelled(found_name, label)
        if version is not None:
            found = versions.get(version)
            if found is None:
                listed = sorted(versions, key=version_key)
                raise NotFoundError(
                    f"model {found_name!r} has no version {quote(version)}; its versions: {listed}"
                )
            return found
        return route(versions, self.traffic.get(found_name), turn=split)

    def _name(self, name: str | None) -> str:
        if name is not None:
            return name
        if self.default_model is not None:
            return self.default_model
        if len(self.models) == 1:
            return next(iter(self.models))
        if not self.models:
            if self.unserved:  # it will not come back by retrying: say how to bring it back
                raise NotFoundError(self._unserved())
            raise NotReadyError(NO_MODEL)
        raise InvalidInputError(
            f"this server serves several models ({_names(self.models)}) and none is the "
            "default; name one in the path (/v1/models/{name}:predict, /v2/models/{name}/infer) "
            "or start the server with --default-model NAME"
        )

    def _no_model(self, name: str, *, default: bool) -> str:
        what = f"the default model {quote(name)}" if default else f"model {quote(name)}"
        why = self.unserved.get(name)
        served = f"this server serves {_names(self.models)}" if self.models else "none is served"
        if why is not None:
            return f"{what} is not served ({why}); {served}; {_load_hint(name)}"
        return f"{what} not found; {served}"

    def _unserved(self) -> str:
        """Why ``/predict`` has no model once every model was unloaded (TF Serving's 404 for a
        model it does not serve, not a 503 that invites a retry)."""
        names = sorted(self.unserved)
        if len(names) == 1:
            (name,) = names
            return (
                f"no model is served: model {name!r} was {self.unserved[name]}; {_load_hint(name)}"
            )
        listed = "; ".join(f"{n!r} {self.unserved[n]}" for n in names)
        return (
            f"no model is served: {listed}; load one with POST "
            "/v2/repository/models/{name}/load (with the admin token)"
        )

    def _labelled(self, name: str, label: str) -> str:
        labels = self.labels.get(name, {})
        version = labels.get(label)
        if version is None:
            known = f"its labels: {sorted(labels)}" if labels else "it has no label set"
            raise NotFoundError(f"model {quote(name)} has no label {quote(label)}; {known}")
        return version


def _load_hint(name: str) -> str:
    return f"load it with POST /v2/repository/models/{name}/load (with the admin token)"


def _names(models: dict[str, dict[str, ServedModel]]) -> str:
    return ", ".join(repr(n) for n in sorted(models))
