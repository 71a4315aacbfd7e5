"""A served version's life as one state machine: its states, the transitions allowed between
them, and the one place a transition happens.

::

    LOADING ──> WARMING ──> READY ──> DRAINING ──> RETIRED
       │           │                    │   ▲
       │           │                    ▼   │ (an unload or a stop while it loads)
       └───────────┴──────────────> FAILED ─┴──> RETIRED

- ``LOADING``: its actors are being made (placement, TensorFlow's import, the weights).
- ``WARMING``: its runner is made; the warm-up batch and the length plan run.
- ``READY``: it takes requests. Whether its replicas serve is a *condition* of READY, not a
  state of its own (``serving.version.readiness``): healthy, recovering (a replica being brought
  back while its requests wait, within their deadline) or degraded (no replica can take a request
  now, or its batcher gave up).
- ``DRAINING``: it refuses new requests with a reason and answers what it holds (a retire, an
  unload, the server's stop, a switch turned back). A load that ends while the version drains
  does not bring it back.
- ``RETIRED``: drained and its actors ended; the registry stops routing to it.
- ``FAILED``: its load failed, or it was turned back after it served (a replica-by-replica switch
  that could not finish); its reason stays for the index until it is retired.

An illegal transition raises ``IllegalTransition``: a caller that would, for example, make a
RETIRED version READY again is a bug to find, not a state to paper over (uvicorn asserts its
lifespan's transitions the same way; Ray Serve's ``ReplicaState`` is the model).

``Life`` is private to ``serving.version``: ``ServedModel`` holds one and is the only writer; every
other module reads ``ServedModel.state``, ``.reason`` and ``.condition()`` (a test fails where one
reads the fields here or the version's old flags).
"""

from __future__ import annotations

import asyncio
import logging
from enum import StrEnum
from typing import Literal

__all__ = ["TRANSITIONS", "IllegalTransition", "IndexState", "Life", "Phase", "VersionState"]

log = logging.getLogger("shardserve")

# A version's state in the repository index (Triton's strings: ``serving.version.readiness``
# derives them from the state machine's).
IndexState = Literal["READY", "LOADING", "UNAVAILABLE"]


class VersionState(StrEnum):
    LOADING = "LOADING"
    WARMING = "WARMING"
    READY = "READY"
    DRAINING = "DRAINING"
    RETIRED = "RETIRED"
    FAILED = "FAILED"


_S = VersionState
TRANSITIONS: dict[VersionState, frozenset[VersionState]] = {
    _S.LOADING: frozenset({_S.WARMING, _S.FAILED, _S.DRAINING}),
    _S.WARMING: frozenset({_S.READY, _S.FAILED, _S.DRAINING}),
    _S.READY: frozenset({_S.DRAINING}),
    _S.DRAINING: frozenset({_S.RETIRED, _S.FAILED}),
    _S.FAILED: frozenset({_S.RETIRED}),
    _S.RETIRED: frozenset(),
}
# The states before a version serves: a request meets "still loading".
LOADING_STATES = frozenset({_S.LOADING, _S.WARMING})
# Where a version stands for a request (``Life.phase``): the one decision every view of "is it
# serving" derives from (a request's refusal, /readyz, the repository index, TF Serving's states).
Phase = Literal["loading", "ready", "stopping", "failed"]


class IllegalTransition(RuntimeError):
    """A transition the version's state machine does not allow."""


class Life:
    """One version's state, why it is there, and the waits on it."""

    def __init__(self, what: str) -> None:
        self._what = what  # "model 'x' version 1", for the log and the errors
        self._state = VersionState.LOADING
        self._reason: str | None = None
        self._served = False  # it reached READY once
        self._changed = asyncio.Event()

    @property
    def state(self) -> VersionState:
        return self._state

    @property
    def reason(self) -> str | None:
        """FAILED: why it failed; DRAINING: why it refuses requests; else None."""
        return self._reason

    @property
    def served(self) -> bool:
        """Its load completed: it reached READY, or would have but for a drain meanwhile."""
        return self._served

    @property
    def phase(self) -> Phase:
        """``failed``: its load failed (or a switch turned it back); ``ready``: READY, it takes
        requests (its condition says how); ``loading``: it has not served yet (LOADING,
        WARMING, or a drain before its load completed); ``stopping``: DRAINING or RETIRED after
        it served."""
        state = self._state
        if state is VersionState.FAILED:
            return "failed"
        if state is VersionState.READY:
            return "ready"
        if state in LOADING_STATES or not self._served:
            return "loading"
        return "stopping"

    def refusal(self) -> str | None:
        """Why its phase refuses a request, in one line; ``None`` when ready (its condition
        then says whether a request is refused)."""
        phase = self.phase
        if phase == "failed":
            return f"model failed to load: {self._reason}"
        if phase == "loading":
            return "model is still loading"
        if phase == "stopping":
            return self._reason or f"model is {self._state.lower()}"
        return None

    def move(self, to: VersionState, reason: str | None = None) -> None:
        """The one transition: ``IllegalTransition`` where ``TRANSITIONS`` does not list it."""
        if to not in TRANSITIONS[self._state]:
            raise IllegalTransition(
                f"{self._what} cannot go from {self._state} to {to} "
                f"(from {self._state} it goes to {sorted(TRANSITIONS[self._state]) or 'nothing'})"
            )
        log.debug("%s: %s -> %s%s", self._what, self._state, to, f" ({reason})" if reason else "")
        self._state = to
        if to is VersionState.READY:
            self._served = True
        if to in (VersionState.FAILED, VersionState.DRAINING):
            self._reason = reason
        elif to is not VersionState.RETIRED:
            self._reason = None
        self._changed.set()
        self._changed = asyncio.Event()

    def advance(self, to: VersionState) -> None:
        """A load's progress (WARMING, READY): a version that began to drain or was retired
        meanwhile stays where it is (a load that completes is still ``served``: its refusal
        then says why, not "still loading")."""
        if self._state in (VersionState.DRAINING, VersionState.RETIRED):
            self._served = self._served or to is VersionState.READY
            return
        self.move(to)

    def fail(self, reason: str) -> bool:
        """FAILED with ``reason`` unless it is FAILED already (the first reason stays) or
        RETIRED; whether it moved."""
        if self._state in (VersionState.FAILED, VersionState.RETIRED):
            return False
        self.move(VersionState.FAILED, reason)
        return True

    def refuse(self, reason: str) -> None:
        """DRAINING with ``reason`` from LOADING, WARMING or READY; else as it is (a draining
        version keeps its first reason, a failed one its failure)."""
        if self._state in (VersionState.LOADING, VersionState.WARMING, VersionState.READY):
            self.move(VersionState.DRAINING, reason)

    async def until(self, *states: VersionState) -> VersionState:
        """Until the version is in one of ``states``; the state it is in then."""
        while self._state not in states:
            await self._changed.wait()
        return self._state
