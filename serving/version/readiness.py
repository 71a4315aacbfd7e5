"""Whether the server is ready (``/readyz``, V2's server ready), and each served version's state
as the repository index shows it: both read from the version's state machine
(``serving.version.life``) and, for a READY version, its condition (``serving.version.condition``).

The server is ready once no version is still loading and at least one is ready: a broken version
in a repository does not take the others out of service, and a load balancer does not send
traffic to a server that is still loading what its repository selects. With one model this is
what it always was: its load failure, its load, a batcher that gave up or no healthy replica is
a 503 with the reason. No healthy replica while one is being brought back is still ready where
its requests can wait for it (a ``recovering`` condition).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from serving.batching.dispatch import SHUTTING_DOWN
from serving.version.life import IndexState
from serving.version.served import ServedModel

__all__ = ["NO_VERSION", "Readiness", "readiness", "version_state"]

Status = Literal["ready", "loading", "failed", "shutting down", "unavailable"]
NO_VERSION = "no model version is served"


@dataclass(frozen=True)
class Readiness:
    status: Status
    model: str | None = None  # when ready: the default model (or the first one ready)
    error: str | None = None  # what /readyz's body says beside the status
    reason: str | None = None  # why not ready in one line (None when ready)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"status": self.status}
        if self.model is not None:
            body["model"] = self.model
        if self.error is not None:
            body["error"] = self.error
        return body


class Served(Protocol):
    """What readiness reads of the server (``serving.server.state.ServerState``)."""

    @property
    def accepting(self) -> bool: ...
    @property
    def default_model(self) -> str | None: ...
    def served(self) -> list[ServedModel]: ...


def readiness(state: Served) -> Readiness:
    served = state.served()
    if not served:
        status: Status = "shutting down" if not state.accepting else "unavailable"
        reason = SHUTTING_DOWN if not state.accepting else NO_VERSION
        return Readiness(status, error=None if not state.accepting else NO_VERSION, reason=reason)
    found = [_of(model) for model in served]
    for one in found:
        if one.status == "loading":
            return one
    ready = [one.model for one in found if one.status == "ready"]
    if ready:
        default = state.default_model
        return Readiness("ready", model=default if default in ready else ready[0])
    for one in found:
        if one.status == "shutting down":
            return one
    return found[0]


def version_state(model: ServedModel) -> tuple[IndexState, str]:
    """READY, LOADING or UNAVAILABLE, and why in one line ("" when READY)."""
    found = _of(model)
    if found.status == "ready":
        return "READY", ""
    if found.status == "loading":
        return "LOADING", found.reason or "loading"
    return "UNAVAILABLE", found.reason or found.status


def _of(model: ServedModel) -> Readiness:
    """One version's readiness, from its phase (``serving.version.life.Life.phase``) and, READY,
    its condition."""
    phase = model.phase
    if phase == "failed":
        return Readiness("failed", error=model.reason, reason=model.not_ready_reason())
    if phase == "loading":
        return Readiness("loading", error=model.waiting, reason=model.not_ready_reason())
    if phase == "stopping":  # DRAINING (or RETIRED, on its way out)
        refusing = model.not_ready_reason()
        status: Status = "shutting down" if refusing == SHUTTING_DOWN else "unavailable"
        error = None if status == "shutting down" else refusing
        return Readiness(status, error=error, reason=refusing)
    condition = model.condition()
    if condition.kind != "degraded":
        return Readiness("ready", model=model.name)
    status = "failed" if condition.gave_up else "unavailable"
    return Readiness(status, error=condition.detail, reason=condition.unavailable)
