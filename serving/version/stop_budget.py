"""One deadline for the whole stop (``stop_timeout_s``), shared by every phase of it.

An orchestrator kills the process after its grace period (``docker stop``: 10 s unless ``-t``;
Kubernetes: ``terminationGracePeriodSeconds``, 30 s by default), and a request cut by that kill
gets no answer at all. So the stop is one budget, split into three phases that each end at a
mark of it, whatever the phases before them took:

1. drain (up to ``drain_until``): the requests already accepted are answered; new ones get 503.
   It ends sooner once the batcher holds nothing.
2. answer (up to ``answer_until``): what is still held (queued rows, batches on a stage that
   hangs) is failed with a 503, and those answers and the last ones are written.
3. close (up to ``deadline``): gRPC stops, the runner's actors are released, the process exits.

A version's retire (a switch, a promotion, an unload) has no orchestrator behind it: its drain
lasts as long as the requests it admitted may (``StopBudget.retire``), then the same phases.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.batching.batcher import Batcher

__all__ = ["StopBudget", "drain_batcher"]

log = logging.getLogger("shardserve")

# Of the budget, the close keeps 20% (at most 5 s: releasing the actors takes milliseconds on a
# live cluster, a Ray that is gone is not waited for) and the answers 10% (at most 2 s).
_CLOSE_SHARE, _CLOSE_MAX_S = 0.2, 5.0
_ANSWER_SHARE, _ANSWER_MAX_S = 0.1, 2.0


@dataclass(frozen=True)
class StopBudget:
    total_s: float
    deadline: float  # time.monotonic()
    # The close's and the answers' seconds at the end; None: their shares of ``total_s``.
    close_s: float | None = None
    answer_s: float | None = None

    @classmethod
    def start(cls, total_s: float) -> StopBudget:
        return cls(total_s, time.monotonic() + total_s)

    @classmethod
    def retire(cls, drain_s: float) -> StopBudget:
        """A retire's: a drain of ``drain_s`` (the latest deadline a request it admitted may
        have), then the longest answer and close phases a stop has."""
        total_s = drain_s + _ANSWER_MAX_S + _CLOSE_MAX_S
        return cls(total_s, time.monotonic() + total_s, _CLOSE_MAX_S, _ANSWER_MAX_S)

    @property
    def answer_until(self) -> float:
        close_s = self.close_s
        if close_s is None:
            close_s = min(_CLOSE_MAX_S, _CLOSE_SHARE * self.total_s)
        return self.deadline - close_s

    @property
    def drain_until(self) -> float:
        answer_s = self.answer_s
        if answer_s is None:
            answer_s = min(_ANSWER_MAX_S, _ANSWER_SHARE * self.total_s)
        return self.answer_until - answer_s

    def left(self) -> float:
        """Seconds to the deadline (0 once past it)."""
        return max(0.0, self.deadline - time.monotonic())

    def answer_left(self) -> float:
        return max(0.0, self.answer_until - time.monotonic())

    def drain_left(self) -> float:
        return max(0.0, self.drain_until - time.monotonic())


async def drain_batcher(batcher: Batcher, budget: StopBudget) -> None:
    """Answer what ``batcher`` holds until the budget's drain mark, then fail the rest with a
    503: every request still waiting gets an answer before the answer mark."""
    try:
        await asyncio.wait_for(batcher.stop(drain=True), budget.drain_left())
        return
    except TimeoutError:
        pass
    log.warning(
        "draining: %d row(s) queued and %d batch(es) in flight not done after %.1f s of the "
        "%g s budget; failing them with 503",
        batcher.queued_rows,
        batcher.inflight_batches,
        budget.total_s - budget.left(),
        budget.total_s,
    )
    # The cancelled drain failed the queued rows and cancelled the batches; a cancelled batch
    # fails its rows as it ends, which this waits for (bounded: a batch ignoring its
    # cancellation must not hold the stop).
    try:
        await asyncio.wait_for(batcher.stop(drain=False), budget.answer_left())
    except TimeoutError:
        log.warning("batches still running at the end of the stop's answer phase")
