"""Stopping the HTTP server without losing a request: SIGTERM drains, a second signal ends it.

uvicorn alone, on SIGTERM, closes its listener at once and answers the requests it holds; a
load balancer still sending to the address meets refused connections, and a second SIGTERM is
ignored (only a second SIGINT forces the exit, and even then the lifespan shutdown runs).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from serving.state import ServerState

log = logging.getLogger("shardserve")
DRAIN_TIMEOUT_S = 30.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a drain before its own shutdown.

    First SIGTERM or SIGINT: the app stops accepting (``/readyz`` and new predict requests answer
    503) while the listener stays open, so clients get a clear answer instead of a refused
    connection. Once the batcher holds no rows (or after ``drain_timeout_s``) uvicorn's shutdown
    runs: the listener closes, open responses finish, the lifespan shutdown closes the runner.
    A second signal ends the process at once.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        state_of: Callable[[], ServerState | None],
        *,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
    ) -> None:
        super().__init__(config)
        self._state_of = state_of
        self._drain_timeout_s = drain_timeout_s
        self._signalled = False
        self._stop_signal: int | None = None  # set while draining
        self._stop_at = 0.0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled:
            log.warning("%s again: stopping at once", signal.Signals(sig).name)
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)
            return
        self._signalled = True
        state = self._state_of()
        if state is None or state.batcher is None or not state.ready.is_set():
            super().handle_exit(sig, frame)  # nothing accepted yet, so nothing to drain
            return
        self._stop_signal = sig
        self._stop_at = time.monotonic()
        state.accepting = False
        batcher = state.batcher
        log.info(
            "%s: refusing new requests; answering %d queued row(s) and %d batch(es) in flight "
            "first (send it again to stop at once)",
            signal.Signals(sig).name,
            batcher.queued_rows,
            batcher.inflight_batches,
        )

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop ticks every 0.1 s: the drain is checked there, no timer of its own.
        if self._stop_signal is not None and not self.should_exit and self._drained():
            super().handle_exit(self._stop_signal, None)
        return await super().on_tick(counter)

    def _drained(self) -> bool:
        state = self._state_of()
        batcher = state.batcher if state is not None else None
        if batcher is None or (batcher.queued_rows == 0 and batcher.inflight_batches == 0):
            return True
        if time.monotonic() - self._stop_at > self._drain_timeout_s:
            log.warning(
                "drain took over %.0f s; stopping with %d row(s) still queued",
                self._drain_timeout_s,
                batcher.queued_rows,
            )
            return True
        return False
