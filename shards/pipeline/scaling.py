"""A ``ReplicaSet`` that grows and shrinks while it serves (issue 22).

``add_replica`` places one more replica: PENDING while its placement group waits for resources
(on a ``ray up`` cluster that pending demand is what makes Ray's autoscaler add a node), STARTING
while its actors load, and in the rotation only after its warm batch. Given up (its group
removed, a WARNING saying what it waited for) when it stays pending past its timeout or fails to
start; the caller may ask again later.

``remove_replica`` takes one out, choosing one that does not serve before one that does: pending,
then starting (both cancelled), then dead or suspect, then the healthy one with the fewest
batches in flight. It leaves the rotation at once (DRAINING), its batches finish (at most
``drain_timeout_s``: then its actors are killed and those batches are retried on another healthy
replica, as after any replica fault), then it is closed. A draining replica is never recovered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

from shards.cluster import pending_placement
from shards.errors import PipelineStartError, one_line
from shards.pipeline.health import ReplicaState
from shards.pipeline.placement import Layout, new_replica, start_replica
from shards.pipeline.replica import Replica
from shards.signature import ModelSignature

log = logging.getLogger(__name__)

# How often a pending replica's line (what its placement group waits for) is read again.
PENDING_POLL_S = 1.0
# How often a draining replica's batches in flight are counted.
DRAIN_POLL_S = 0.01
# Which replica a scale-down takes first: the ones that serve nothing yet, the ones out of the
# rotation, and only then one that serves.
_REMOVAL_ORDER = {
    ReplicaState.PENDING: 0,
    ReplicaState.STARTING: 1,
    ReplicaState.DEAD: 2,
    ReplicaState.SUSPECT: 3,
    ReplicaState.HEALTHY: 4,
}


class Elastic:
    """Adding and removing replicas; mixed into ``shards.pipeline.replica_set.ReplicaSet``,
    which holds the state below. Replicas are keyed by an id that is never reused."""

    signature: ModelSignature
    _replicas: dict[int, Replica]
    _ids: Iterator[int]
    _layout: Layout
    _closed: bool
    _recovery: dict[int, asyncio.Task[None]]
    _left_at: dict[int, float]
    _starting: dict[int, asyncio.Task[bool]]
    _waits_for: dict[int, str]
    _replicas_at_close: int

    @property
    def replicas(self) -> int:
        """Every replica, in any state (pending, starting and draining ones included); once
        closed, how many there were."""
        return self._replicas_at_close if self._closed else len(self._replicas)

    async def add_replica(self, pending_timeout_s: float) -> bool:
        """Place and start one more replica; True once it serves, False when it was given up
        (pending past ``pending_timeout_s``, failed to start, removed while starting, or the
        set closed). A cancelled call removes what it placed."""
        if pending_timeout_s <= 0:
            raise ValueError(f"pending_timeout_s must be > 0, got {pending_timeout_s}")
        if self._closed:
            return False
        rid = next(self._ids)
        replica = new_replica(self._layout)
        replica.state = ReplicaState.PENDING
        self._replicas[rid] = replica
        # Its own task: a scale-down cancels the start without cancelling this caller. Not a
        # background task: this call awaits it and returns its result (``_start`` turns a
        # failure into False, logged), so its raise is its caller's.
        task = asyncio.create_task(self._start(rid, replica, pending_timeout_s), name=f"add-{rid}")
        self._starting[rid] = task
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        return not task.cancelled() and task.result()

    async def _start(self, rid: int, replica: Replica, pending_timeout_s: float) -> bool:
        try:
            await self._placed(rid, replica, pending_timeout_s)
            replica.state = ReplicaState.STARTING
            await start_replica(replica, self._layout, self.signature, rid)
        except asyncio.CancelledError:
            await self._discard(rid, replica)
            raise
        except Exception as exc:
            why = str(exc) if isinstance(exc, PipelineStartError) else one_line(exc)
            log.warning("replica %d given up: %s", rid, why)
            await self._discard(rid, replica)
            return False
        finally:
            self._starting.pop(rid, None)
            self._waits_for.pop(rid, None)
        replica.state = ReplicaState.HEALTHY
        log.info("replica %d joins the rotation: started and warm", rid)
        return True

    async def _placed(self, rid: int, replica: Replica, timeout_s: float) -> None:
        """Return once the replica's placement group is placed; while it waits, keep what it
        waits for; past ``timeout_s`` raise saying so."""
        began = time.monotonic()
        ready = asyncio.ensure_future(replica.placement_group.ready())  # awaited below, raise too
        try:
            poll = 0.1  # a group that can be placed is placed in milliseconds
            while True:
                left = timeout_s - (time.monotonic() - began)
                done, _ = await asyncio.wait({ready}, timeout=max(0.0, min(poll, left)))
                if done:
                    ready.result()
                    return
                why = await asyncio.to_thread(pending_placement, [replica.placement_group])
                if why:
                    self._waits_for[rid] = why
                if time.monotonic() - began >= timeout_s:
                    raise PipelineStartError(
                        f"pending for {timeout_s:g} s (its pending timeout), "
                        + self._waits_for.get(rid, "its placement group not placed")
                    )
                poll = PENDING_POLL_S
        finally:
            ready.cancel()

    async def _discard(self, rid: int, replica: Replica) -> None:
        self._replicas.pop(rid, None)
        self._waits_for.pop(rid, None)
        # Ray's kill/remove calls block: off the event loop.
        await asyncio.to_thread(replica.close)

    async def remove_replica(self, drain_timeout_s: float) -> bool:
        """Take one replica out (see the module's docstring); False when that would leave none.
        True once it is closed."""
        if drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
        rid = self._removal_choice()
        if rid is None:
            return False
        replica = self._replicas[rid]
        was = replica.state
        replica.state = ReplicaState.DRAINING
        self._left_at.pop(rid, None)
        log.info("replica %d (%s) leaves: scaling down", rid, was.value)
        task: asyncio.Task[bool] | asyncio.Task[None] | None = self._starting.pop(
            rid, None
        ) or self._recovery.pop(rid, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        deadline = time.monotonic() + drain_timeout_s
        while replica.inflight and time.monotonic() < deadline and not self._closed:
            await asyncio.sleep(DRAIN_POLL_S)
        if replica.inflight:
            log.warning(
                "replica %d: %d batch(es) still running after its drain timeout of %g s; its "
                "actors are killed and those batches retried on another replica",
                rid,
                replica.inflight,
                drain_timeout_s,
            )
        await asyncio.to_thread(replica.close)
        self._replicas.pop(rid, None)
        log.info("replica %d removed", rid)
        return True

    def _removal_choice(self) -> int | None:
        """The replica a scale-down takes, or None when it would leave no replica. The last
        healthy one is never taken while others are not healthy: those go first."""
        live = {i: r for i, r in self._replicas.items() if r.state is not ReplicaState.DRAINING}
        if len(live) <= 1:
            return None

        def cost(rid: int) -> tuple[int, int, int]:
            replica = live[rid]
            # Newest first among equals: the one furthest from serving, or that served least.
            return (_REMOVAL_ORDER.get(replica.state, 0), replica.inflight, -rid)

        return min(live, key=cost)

    def pending_reason(self) -> str:
        return " | ".join(dict.fromkeys(self._waits_for.values()))
