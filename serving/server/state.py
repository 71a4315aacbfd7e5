"""What one server holds while it runs: its settings, metrics, whether it takes requests, the
stop's budget, and the models it serves (``serving.server.model``), by name."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serving.config import Settings
from serving.errors import NotFoundError, NotReadyError
from serving.server.metrics import Metrics
from serving.server.stop_budget import StopBudget

if TYPE_CHECKING:
    from serving.server.model import ServedModel

SHUTTING_DOWN = "server is shutting down"
NO_MODEL = "no model is served yet; retry when GET /readyz answers 200"


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    # By name, the default (the one /predict serves) first.
    models: dict[str, ServedModel] = field(default_factory=dict)
    # Set when the server starts stopping: every phase of the stop shares this one deadline.
    stop_budget: StopBudget | None = None

    @property
    def accepting(self) -> bool:
        """The server takes new requests: it has not begun to stop."""
        return self.stop_budget is None

    def add_model(self, model: ServedModel) -> None:
        if model.name in self.models:
            raise ValueError(f"model {model.name!r} is served already; give each a unique name")
        if not self.accepting:
            model.stop_accepting(SHUTTING_DOWN)
        self.models[model.name] = model

    def model(self, name: str | None = None, version: str | None = None) -> ServedModel:
        """The model served as ``name`` (and ``version``, when given); without a name the
        default one (``/predict``'s)."""
        if name is None:
            for default in self.models.values():
                return default
            raise NotReadyError(NO_MODEL)
        found = self.models.get(name)
        if found is None:
            served = ", ".join(repr(n) for n in self.models)
            raise NotFoundError(f"model {name!r} not found; this server serves {served}")
        if version is not None and version != found.version:
            raise NotFoundError(
                f"model {name!r} has no version {version!r}; its versions: {[found.version]}"
            )
        return found

    def not_ready_reason(self) -> str | None:
        """Why the server as a whole is not ready (one of its models is not), or ``None``."""
        if not self.models:
            return NO_MODEL
        for model in self.models.values():
            reason = model.not_ready_reason()
            if reason is not None:
                return reason
        return None

    def begin_stop(self) -> StopBudget:
        """Refuse new requests from now on; the stop's budget (``stop_timeout_s``), started by
        the first caller and shared by the later ones."""
        for model in self.models.values():
            model.stop_accepting(SHUTTING_DOWN)
        if self.stop_budget is None:
            self.stop_budget = StopBudget.start(self.settings.stop_timeout_s)
        return self.stop_budget

    async def drain(self, budget: StopBudget) -> None:
        """Every model answers what it holds, until the budget's drain mark."""
        await asyncio.gather(*(model.drain(budget) for model in self.models.values()))


if TYPE_CHECKING:
    from serving.http.model import ModelDirectory, ModelHandle

    def _what_the_routes_see(state: ServerState) -> tuple[ModelDirectory, ModelHandle]:
        # For mypy only: the state is the routes' directory, each of its models a handle.
        return state, state.model()
