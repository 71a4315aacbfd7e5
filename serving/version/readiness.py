"""Whether the server is ready (``/readyz``, V2's server ready), and each served version's state
as the repository index shows it.

The server is ready once no version is still loading and at least one is ready: a broken version
in a repository does not take the others out of service, and a load balancer does not send
traffic to a server that is still loading what its repository selects. With one model this is
what it always was: its load failure, its load, a batcher that gave up or no healthy replica is
a 503 with the reason. No healthy replica while one is being brought back is still ready where
its requests can wait for it (``replicas_unavailable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from serving.batching.dispatch import SHUTTING_DOWN

if TYPE_CHECKING:
    from serving.http.model import VersionState
    from serving.server.state import ServerState
    from serving.version.served import ServedModel

__all__ = ["NO_VERSION", "Readiness", "readiness", "replicas_unavailable", "version_state"]

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


def readiness(state: ServerState) -> Readiness:
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


def version_state(model: ServedModel) -> tuple[VersionState, str]:
    """READY, LOADING or UNAVAILABLE, and why in one line ("" when READY)."""
    found = _of(model)
    if found.status == "ready":
        return "READY", ""
    if found.status == "loading":
        return "LOADING", found.reason or "loading"
    return "UNAVAILABLE", found.reason or found.status


def _of(model: ServedModel) -> Readiness:
    """One version's readiness: the checks in /readyz's order of old."""
    if model.load_error:
        return Readiness("failed", error=model.load_error, reason=model.not_ready_reason())
    if not model.ready.is_set():
        waiting = model.load_waiting
        return Readiness("loading", error=waiting, reason=model.not_ready_reason())
    if model.refusing is not None:
        status: Status = "shutting down" if model.refusing == SHUTTING_DOWN else "unavailable"
        error = None if status == "shutting down" else model.refusing
        return Readiness(status, error=error, reason=model.refusing)
    if model.batcher_failure:
        return Readiness("failed", error=model.batcher_failure, reason=model.batcher_failure)
    reason = replicas_unavailable(model)
    if reason is not None:
        health = model.health()
        fault = health.reason if health is not None else ""
        error = f"{reason} (last fault: {fault})" if fault else reason
        return Readiness("unavailable", error=error, reason=reason)
    return Readiness("ready", model=model.name)


def replicas_unavailable(model: ServedModel) -> str | None:
    """Why the version's replicas cannot take a request now, or None.

    None is healthy, but one being brought back (a Ray restart, a rebuild) that is expected back
    within a request's deadline (the last recovery's time) while the queue has room still takes
    requests: they wait for it (``serving.batching.hold``). A single pod behind a Service must not
    leave its endpoints for a restart of seconds; it does once it cannot take more."""
    health = model.health()
    if health is None or health.ok:
        return None
    reason = f"no healthy replica of {health.replicas}; rebuilding"
    batcher = model.batcher
    if not health.recovering or batcher is None:
        return reason
    deadline_s = model.settings.request_timeout_ms / 1000.0
    if health.back_in_s > deadline_s:
        return f"{reason}, expected back in {health.back_in_s:.3g} s, past a request's deadline"
    if batcher.queued_rows >= batcher.settings.max_queue_rows:
        return f"{reason}; the queue is full meanwhile"
    return None
