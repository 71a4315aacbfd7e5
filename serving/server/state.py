"""What one server holds while it runs: its settings, metrics, whether it takes requests, the
stop's budget, its repository manager (``serving.repository.manager``), and the versions it
serves (``serving.version.served``) by model name and version, with the labels that point at them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serving.batching.dispatch import SHUTTING_DOWN
from serving.elastic.loop import inherit_count
from serving.errors import InvalidInputError, NotFoundError, NotReadyError
from serving.http.body_deadline import body_deadlines
from serving.metrics.series import Metrics
from serving.settings.config import Settings
from serving.version.readiness import readiness
from serving.version.stop_budget import StopBudget

if TYPE_CHECKING:
    from serving.canary.controller import Rollout
    from serving.repository.manager import Repository
    from serving.repository.replica_switch import RollingSplit
    from serving.version.served import ServedModel

__all__ = ["NO_MODEL", "SHUTTING_DOWN", "ServerState"]

NO_MODEL = "no model is served yet; retry when GET /readyz answers 200"


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    # name -> version -> the served version (a failed load stays, with its reason, until unload)
    models: dict[str, dict[str, ServedModel]] = field(default_factory=dict)
    # name -> label -> version; a label points only at a READY version (the manager sees to it)
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    default_model: str | None = None  # /predict's model; None: the only one served
    # name -> its canary's controller (a model whose config.toml has [traffic]): it splits the
    # requests that name no version between its stable version and its canary
    rollouts: dict[str, Rollout] = field(default_factory=dict)
    # name -> the split of a version switch replica by replica
    # (``serving.repository.replica_switch``):
    # requests that name no version go to the old or the new version by their healthy replicas
    splits: dict[str, RollingSplit] = field(default_factory=dict)
    repository: Repository | None = None
    # Why a model the repository knows is not served (unloaded through the API): the 404 says it.
    unserved: dict[str, str] = field(default_factory=dict)
    # Set when the server starts stopping: every phase of the stop shares this one deadline.
    stop_budget: StopBudget | None = None

    def __post_init__(self) -> None:
        if self.default_model is None:
            self.default_model = self.settings.default_model

    @property
    def accepting(self) -> bool:
        """The server takes new requests: it has not begun to stop."""
        return self.stop_budget is None

    def add_model(self, model: ServedModel) -> None:
        versions = self.models.setdefault(model.name, {})
        if model.version in versions:
            raise ValueError(
                f"model {model.name!r} version {model.version!r} is served already; "
                "give each a unique name and version"
            )
        if not self.accepting:
            model.stop_accepting(SHUTTING_DOWN)
        inherit_count(model, versions.values())  # a version switch keeps the replicas serving
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
            for v in sorted(versions, key=_version_key)
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
                f"name a version ({version!r}) or a label ({label!r}) of the model, not both"
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
                listed = sorted(versions, key=_version_key)
                raise NotFoundError(
                    f"model {found_name!r} has no version {version!r}; its versions: {listed}"
                )
            return found
        rollout = self.rollouts.get(found_name) or self.splits.get(found_name)
        if rollout is not None:
            picked = versions.get(rollout.pick() if split else rollout.peek())
            if picked is not None and picked.not_ready_reason() is None:
                return picked
        ordered = sorted(versions.values(), key=lambda m: _version_key(m.version))
        ready = [m for m in ordered if m.not_ready_reason() is None]
        return (ready or ordered)[-1]

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
        what = f"the default model {name!r}" if default else f"model {name!r}"
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
            raise NotFoundError(f"model {name!r} has no label {label!r}; {known}")
        return version

    def not_ready_reason(self) -> str | None:
        """Why the server as a whole is not ready, or ``None``: ready once no version is still
        loading and at least one is ready (``serving.version.readiness``)."""
        return readiness(self).reason

    def begin_stop(self) -> StopBudget:
        """Refuse new requests from now on; the stop's budget (``stop_timeout_s``), started by
        the first caller and shared by the later ones."""
        for model in self.served():
            model.stop_accepting(SHUTTING_DOWN)
        if self.stop_budget is None:
            self.stop_budget = StopBudget.start(self.settings.stop_timeout_s)
        return self.stop_budget

    async def drain(self, budget: StopBudget) -> None:
        """Every served version answers what it holds, until the budget's drain mark.

        A body still arriving then is cut with a 503 and its connection closed
        (``BodyDeadlines.cut_all``): ``body_read_timeout_s`` (30 s) outlasts the drain (18 s
        of the 25 s budget), so a client trickling its body would otherwise hold its version's
        drain to the mark and the stop's answer phase to its end, then be cut unanswered."""

        async def drain_one(model: ServedModel) -> None:
            if not await model.admitted.wait_idle(budget.drain_left()):
                # Every version is at the mark: the reads of all of them are cut. Each answers
                # its 503 and lets go of its admission on its own, while the batcher's drain
                # fails what it still holds (not waited for here: a hung batch holds some).
                body_deadlines().cut_all()
            await model.drain(budget)

        await asyncio.gather(*(drain_one(model) for model in self.served()))


def _version_key(version: str) -> tuple[int, str]:
    # Versions are positive integers as strings: "10" after "9".
    return (int(version), "") if version.isdigit() else (0, version)


def _load_hint(name: str) -> str:
    return f"load it with POST /v2/repository/models/{name}/load (with the admin token)"


def _names(models: dict[str, dict[str, ServedModel]]) -> str:
    return ", ".join(repr(n) for n in sorted(models))


if TYPE_CHECKING:
    from serving.http.model import ModelDirectory, ModelHandle

    def _what_the_routes_see(state: ServerState) -> tuple[ModelDirectory, ModelHandle]:
        # For mypy only: the state is the routes' directory, each of its models a handle.
        return state, state.model()
