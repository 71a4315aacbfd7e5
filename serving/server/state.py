"""What one server holds while it runs: the registry of what it serves
(``serving.repository.registry``: the versions, their labels, the traffic splits), whether it
takes requests and the stop's budget, and the drain of every version at the stop. It holds data,
not the managers that move versions (``serving.repository.reconciler``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serving.batching.dispatch import SHUTTING_DOWN
from serving.http.body_deadline import body_deadlines
from serving.repository.reconciler import refuse_all
from serving.repository.registry import NO_MODEL, Registry
from serving.version.readiness import readiness
from serving.version.stop_budget import StopBudget

if TYPE_CHECKING:
    from serving.protocols.contract import RepositoryControl
    from serving.version.served import ServedModel

__all__ = ["NO_MODEL", "SHUTTING_DOWN", "ServerState"]


@dataclass
class ServerState(Registry):
    # The repository API's control (``serving.protocols.contract.RepositoryControl``), for the
    # routes that look it up here: set by the lifespan.
    repository: RepositoryControl | None = None
    # Set when the server starts stopping: every phase of the stop shares this one deadline.
    stop_budget: StopBudget | None = None

    @property
    def accepting(self) -> bool:
        """The server takes new requests: it has not begun to stop."""
        return self.stop_budget is None

    def not_ready_reason(self) -> str | None:
        """Why the server as a whole is not ready, or ``None``: ready once no version is still
        loading and at least one is ready (``serving.version.readiness``)."""
        return readiness(self).reason

    @property
    def available(self) -> bool:
        """The server as a whole is ready: what V2's server ready and gRPC health answer."""
        return readiness(self).reason is None

    def begin_stop(self) -> StopBudget:
        """Refuse new requests from now on; the stop's budget (``stop_timeout_s``), started by
        the first caller and shared by the later ones."""
        if self.stop_budget is None:
            self.stop_budget = StopBudget.start(self.settings.stop_timeout_s)
        refuse_all(self)  # the reconciler's stop step, at once
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


if TYPE_CHECKING:
    from serving.protocols.contract import ModelDirectory, ModelHandle

    def _what_the_routes_see(state: ServerState) -> tuple[ModelDirectory, ModelHandle]:
        # For mypy only: the state is the routes' directory, each of its models a handle.
        return state, state.model()
