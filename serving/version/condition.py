"""How a READY version serves now, from its replicas and its batcher: a condition of the READY
state (``serving.version.life``), not a state of its own, since it comes and goes with a
replica's fault and recovery while the version stays loaded and routed to.

- ``healthy``: a replica can take a request.
- ``recovering``: none can right now, but one is being brought back (a Ray restart, a rebuild)
  and is expected back within a request's deadline (the last recovery's time) while the queue
  has room: requests still queue and wait for it (``serving.batching.hold``). A single pod behind
  a Service must not leave its endpoints for a restart of seconds.
- ``degraded``: no replica can take a request and none is expected back in time (or its queue
  is full meanwhile), or the batcher gave up (its loop kept crashing): a 503 with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from serving.batching.batcher import Batcher
from shards.pipeline.health import Health

__all__ = ["Condition", "condition_of"]

Kind = Literal["healthy", "recovering", "degraded"]


@dataclass(frozen=True)
class Condition:
    kind: Kind
    # degraded: why a request is refused now, in one line; else None
    unavailable: str | None = None
    # degraded: what /readyz's body says (the reason and the replicas' last fault)
    detail: str | None = None
    gave_up: bool = False  # degraded because its batcher gave up (not its replicas)


HEALTHY = Condition("healthy")


def condition_of(health: Health | None, batcher: Batcher | None, timeout_ms: float) -> Condition:
    """The condition of a READY version whose replicas report ``health`` (None: no runner) and
    whose batcher is ``batcher``; ``timeout_ms`` is a request's deadline."""
    if batcher is not None and batcher.failure:
        return Condition("degraded", batcher.failure, batcher.failure, gave_up=True)
    if health is None or health.ok:
        return HEALTHY
    reason = f"no healthy replica of {health.replicas}; rebuilding"
    if health.recovering and batcher is not None:
        deadline_s = timeout_ms / 1000.0
        if health.back_in_s > deadline_s:
            reason = (
                f"{reason}, expected back in {health.back_in_s:.3g} s, past a request's deadline"
            )
        elif batcher.queued_rows >= batcher.settings.max_queue_rows:
            reason = f"{reason}; the queue is full meanwhile"
        else:
            return Condition("recovering")
    fault = health.reason
    return Condition("degraded", reason, f"{reason} (last fault: {fault})" if fault else reason)
