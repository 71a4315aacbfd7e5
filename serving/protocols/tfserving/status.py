"""A served version's state in TF Serving's words (``ModelVersionStatus.State``), for both the
REST status route (``GET /v1/models/{m}``) and gRPC's ``ModelService.GetModelStatus``.

TF Serving's states are START, LOADING, AVAILABLE, UNLOADING and END; it has no FAILED. A
version whose load failed (``serving.version.life``'s FAILED) reads END with its error: the
state TF Serving leaves a version in when its load fails, and what a TF Serving client checks
for. The status's code is OK for AVAILABLE, else UNAVAILABLE; its message says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from serving.protocols.contract import ModelHandle

__all__ = ["State", "TFServingStatus", "tfserving_status"]

State = Literal["START", "LOADING", "AVAILABLE", "UNLOADING", "END"]


@dataclass(frozen=True)
class TFServingStatus:
    state: State
    message: str

    @property
    def error_code(self) -> Literal["OK", "UNAVAILABLE"]:
        return "OK" if self.state == "AVAILABLE" else "UNAVAILABLE"


def tfserving_status(model: ModelHandle) -> TFServingStatus:
    """TF Serving's state of the version, and its message.

    A replica being brought back while requests wait for it (a ``recovering`` READY) is still
    AVAILABLE: /readyz and V2 ready say 200 then, and the replica counts say why. A version whose
    replicas cannot serve (``degraded``) reads LOADING; one whose load failed, or whose batcher
    gave up (it will not serve again in this process), END with the error. Its words come from
    the version's phase (``serving.version.life.Life.phase``) and condition alone."""
    phase = model.phase
    if phase == "failed":
        return TFServingStatus("END", model.reason or "")
    if phase == "loading":
        return TFServingStatus("LOADING", "")
    condition = model.condition()
    if condition.gave_up:
        return TFServingStatus("END", condition.unavailable or "")
    if condition.kind == "degraded":
        return TFServingStatus("LOADING", "")
    if phase == "ready":
        return TFServingStatus("AVAILABLE", "")
    return TFServingStatus("UNLOADING", model.reason or "")  # DRAINING, or RETIRED on its way out
