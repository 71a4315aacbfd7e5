"""Stopping the HTTP server within one budget: SIGTERM drains, a second signal ends it.

uvicorn alone, on SIGTERM, closes its listener at once, gives open responses its own timeout,
then runs the lifespan shutdown with no limit of its own: a load balancer still sending to the
address meets refused connections, and the phases add up past any orchestrator's grace period
(which then kills the process mid-drain, cutting requests without an answer). A second SIGTERM
is ignored (only a second SIGINT forces the exit, and even then the lifespan shutdown runs).
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

from serving.server.state import ServerState
from serving.version.stop_budget import StopBudget

log = logging.getLogger("shardserve")
DEFAULT_STOP_TIMEOUT_S = 25.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a drain before its own shutdown, all within ``stop_timeout_s``.

    First SIGTERM or SIGINT: the app stops accepting (``/readyz`` and new requests answer 503)
    while the listener stays open, so clients get a clear answer instead of a refused
    connection. Each model's batcher answers what it holds until the budget's drain mark
    (``serving.version.stop_budget``) and what is left then gets a 503; then uvicorn's shutdown runs
    (the listener closes, open responses finish) and the lifespan shutdown (gRPC, the runner),
    each bounded by what is left of the same budget. A second signal ends the process at once.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        state_of: Callable[[], ServerState | None],
        *,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
    ) -> None:
        super().__init__(config)
        self._state_of = state_of
        self._stop_timeout_s = stop_timeout_s  # used before the app has its settings in state
        self._signalled = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled:
            log.warning("%s again: stopping at once", signal.Signals(sig).name)
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)
            return
        self._signalled = True
        state = self._state_of()
        if state is not None:
            budget = state.begin_stop()
            # (a batcher is set once a load completes)
            serving = [m.batcher for m in state.served() if m.batcher is not None]
            if serving:
                log.info(
                    "%s: refusing new requests; answering %d queued row(s) and %d batch(es) in "
                    "flight first, within the %g s stop budget (send it again to stop at once)",
                    signal.Signals(sig).name,
                    sum(b.queued_rows for b in serving),
                    sum(b.inflight_batches for b in serving),
                    budget.total_s,
                )
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = self._state_of()
        if state is None:
            budget = StopBudget.start(self._stop_timeout_s)
        else:
            budget = state.begin_stop()
            # Before uvicorn's shutdown, so that the listener still answers (503) meanwhile.
            await state.drain(budget)
        # uvicorn cancels the responses still open past this (they had their answers by now);
        # it hands the value to asyncio.wait_for, which takes any number of seconds.
        self.config.timeout_graceful_shutdown = budget.answer_left()  # type: ignore[assignment]
        await super().shutdown(sockets)
