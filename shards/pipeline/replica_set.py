"""R replicas of the model side by side (data parallel), kept healthy, grown and shrunk.

It is one idea, a replica set: its replicas, their health, their recovery, and adding and
removing them. It passes 500 lines because those four share one table of replicas and one
rotation (a replica being recovered, started or drained is the same entry seen at another
moment), and the mixin they were once split into had to re-declare ten of its private fields.

Each batch goes to the least-loaded healthy replica (``shards.pipeline.replica.Replica``). A
batch that a replica fails to answer (a stage process died, or the batch ran past the watchdog's
limit) is retried once on another healthy replica, and the replica leaves the rotation until
``shards.pipeline.recovery`` brings it back: probed (Ray restarts a dead actor that has restarts
left) or, when its actors are gone, rebuilt in the background with a new placement group and
actors, with backoff; it rejoins after one warm batch. ``shards.pipeline.placement`` starts the
replicas; ``add_replica`` and ``remove_replica`` (below) add and remove them while the set
serves. Replicas are kept by an id that is never reused (in logs, stats and recovery tasks).

Where no other replica is healthy (one replica, the default) and one is being brought back, a
batch that hung fails at once with its ``StageTimeoutError`` (rerun on the replica it hung, it
would cost a second watchdog period and a second restart), and every other batch of the replica
(lost with it, or arriving while it recovers) with a ``ReplicaRecoveringError`` whose ``back`` is
done when a replica rejoins: the caller (``serving.batching.hold``) holds the rows until then.
Its ``suspect`` flag marks the batch that was oldest on the replica when a stage died: it may be
what killed it, so it gets one more try, alone. Once a recovery fails (a rebuild attempt failed)
or none is under way, a batch is refused at once with a ``NoHealthyReplicaError`` that says when
to try again.

A model that raises on a batch is the batch's fault, not the replica's: that error goes back to
the caller as a ``ModelError`` and the replica stays in. Every error that leaves is a one-line
``RunError``.

Growing and shrinking (issue 22): ``add_replica`` places one more replica: PENDING while its
placement group waits for resources (on a ``ray up`` cluster that pending demand is what makes
Ray's autoscaler add a node), STARTING while its actors load, and in the rotation only after its
warm batch. Given up (its group removed, a WARNING saying what it waited for) when it stays
pending past its timeout or fails to start; the caller may ask again later.

``remove_replica`` takes one out, choosing one that does not serve before one that does: pending,
then starting (both cancelled), then dead or suspect, then the healthy one with the fewest
batches in flight. It leaves the rotation at once (DRAINING), its batches finish (at most
``drain_timeout_s``: then its actors are killed and those batches are retried on another healthy
replica, as after any replica fault), then it is closed. A draining replica is never recovered.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray

from shards import tracing
from shards.bundle.format import Manifest, read_manifest
from shards.bundle.tensor_routes import plan_routes
from shards.cluster import pending_placement, placement_resources
from shards.errors import (
    InsufficientResourcesError,
    NoHealthyReplicaError,
    PipelineStartError,
    ReplicaRecoveringError,
    RunError,
    StageTimeoutError,
    one_line,
)
from shards.pipeline.faults import is_replica_fault, translate
from shards.pipeline.health import Health, ReplicaState
from shards.pipeline.options import PipelineOptions
from shards.pipeline.placement import Layout, new_replica, start_replica, start_replicas
from shards.pipeline.recovery import REBUILD_BACKOFF_S, Recovered, recover
from shards.pipeline.replica import Replica
from shards.pipeline.watchdog import Watchdog
from shards.signature import ModelSignature

log = logging.getLogger(__name__)

__all__ = [
    "InsufficientResourcesError",
    "PipelineOptions",
    "PipelineStartError",
    "Replica",
    "ReplicaSet",
    "placement_resources",
    "plan_routes",
]

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


class ReplicaSet:
    """R replicas of the pipeline; each batch goes to the least-loaded healthy one."""

    def __init__(
        self,
        manifest: Manifest,
        pipelines: list[Replica],
        layout: Layout,
        start_s: float = REBUILD_BACKOFF_S[0],
    ) -> None:
        self.signature: ModelSignature = manifest.signature
        self.num_stages = len(manifest.stages)
        # Stages one after the other (a split layer's parts side by side count once).
        self.pipeline_depth = manifest.depth
        self.on_gpu = layout.actor.gpus > 0
        self._replicas = dict(enumerate(pipelines))
        self._ids = itertools.count(len(pipelines))
        self._layout = layout
        self._rotation = itertools.count()
        self._watchdog = Watchdog(layout.options.batch_hard_timeout_s)
        self._recovery: dict[int, asyncio.Task[None]] = {}
        self._starting: dict[int, asyncio.Task[bool]] = {}
        self._waits_for: dict[int, str] = {}  # what each pending replica's group waits for
        self._replicas_at_close = 0
        # When each replica out of the rotation left it, and how long the last one took to come
        # back (the start-up's time until one has): what a refused request is told to wait.
        self._left_at: dict[int, float] = {}
        self._recovery_s = start_s
        self._rebuilds = 0
        self._recoveries = 0
        self._last_fault = ""
        self._closed = False
        # Done when a replica rejoins (None) or a recovery fails (why): what held batches wait
        # for while none is in the rotation. A failed recovery refuses batches until one rejoins.
        self._back: asyncio.Future[str | None] | None = None
        self._recovery_failed: str | None = None
        # Told the name of a background task of the set (``recovery``) that raised past its own
        # handling: the server appends its error counter here (shards imports no serving).
        self.task_errors: list[Callable[[str], None]] = []

    @classmethod
    async def create(cls, bundle_dir: str | Path, options: PipelineOptions) -> ReplicaSet:
        began = time.monotonic()
        manifest = read_manifest(bundle_dir)
        pipelines, layout = await start_replicas(Path(bundle_dir), manifest, options)
        return cls(manifest, pipelines, layout, start_s=time.monotonic() - began)

    @property
    def replicas(self) -> int:
        """Every replica, in any state (pending, starting and draining ones included); once
        closed, how many there were."""
        return self._replicas_at_close if self._closed else len(self._replicas)

    # --- running batches

    async def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.signature.input_names if n not in inputs]
        if missing:
            raise KeyError(
                f"inputs {missing} missing; model {self.signature.name!r} wants "
                f"{self.signature.input_names}, got {sorted(inputs)}"
            )
        tried: list[Replica] = []
        attempts = victims = 0
        # The first try and one retry after a replica fault this batch may have caused; a batch
        # that only waited behind the cause is retried without counting, a few times at most.
        while True:
            pipeline = self._pick(tried)
            tried.append(pipeline)
            if tracing.BATCH.get() is not None:  # a traced batch: which replica, which try
                tracing.note("shardserve.replica", self._id_of(pipeline) or 0)
                tracing.note("shardserve.replica_tries", len(tried))
            try:
                return await pipeline.run(inputs, self._watchdog)
            except RunError as error:
                if not is_replica_fault(error):
                    raise
                tracing.note_event(
                    "replica fault",
                    replica=self._id_of(pipeline) or 0,
                    reason=error.message,
                )
                if isinstance(error, StageTimeoutError):
                    # Past the watchdog's limit: the replica's stage actors are killed (a
                    # running task is not interrupted otherwise) and restarted.
                    tracing.note_event(
                        "watchdog kill",
                        replica=self._id_of(pipeline) or 0,
                        reason=error.message,
                        waited_behind=error.victim,
                    )
                self._fault(pipeline, error)
                if error.victim:
                    victims += 1
                else:
                    attempts += 1
                if not self._in_rotation():
                    if isinstance(error, StageTimeoutError) and not error.victim:
                        raise  # hung: never rerun on the replica it hung
                    if self._closed:
                        raise self._unavailable() from None
                    if attempts >= 2:
                        raise type(error)(f"{error.message}, on two replicas") from None
                    if self._recovering():
                        raise self._held(suspect=not error.victim) from None
                    raise self._unavailable() from None
                if attempts >= 2 or victims > self.replicas + 1:
                    # Twice lost: the batch itself may be what kills or hangs the stages, and
                    # a third replica's restarts are not to be burnt on it.
                    raise type(error)(f"{error.message}, on two replicas") from None

    run_batch = run

    def _pick(self, tried: Sequence[Replica]) -> Replica:
        """The least-loaded healthy replica, one not tried yet if there is one."""
        healthy = [] if self._closed else self._in_rotation()
        fresh = [p for p in healthy if p not in tried]
        candidates = fresh or healthy
        if not candidates:
            if self._recovering():
                raise self._held(suspect=False)
            raise self._unavailable()
        return min(candidates, key=lambda p: p.inflight)

    def _recovering(self) -> bool:
        """None serves, and one is being brought back with no failure yet: a batch may wait."""
        return (
            not self._closed
            and self._recovery_failed is None
            and bool(self._recovery)
            and not any(p.state is ReplicaState.HEALTHY for p in self._replicas.values())
        )

    def _held(self, suspect: bool) -> ReplicaRecoveringError:
        if self._back is None or self._back.done():
            self._back = asyncio.get_running_loop().create_future()
        refused = self._unavailable()
        return ReplicaRecoveringError(
            refused.message, refused.retry_after_s, back=self._back, suspect=suspect
        )

    def _release_held(self, why: str | None) -> None:
        if self._back is not None and not self._back.done():
            self._back.set_result(why)

    def _unavailable(self) -> NoHealthyReplicaError:
        if self._closed:
            return NoHealthyReplicaError("the model's replicas are shut down", retry_after_s=1.0)
        # The replica out the longest is the one expected back first.
        now = time.monotonic()
        out_for = max((now - t for t in self._left_at.values()), default=0.0)
        return NoHealthyReplicaError(
            f"no healthy replica of {self.replicas}"
            + (f" (last fault: {self._last_fault})" if self._last_fault else ""),
            retry_after_s=max(1.0, self._recovery_s - out_for),
        )

    def _in_rotation(self) -> list[Replica]:
        # Rotating the scan start breaks ties, so idle replicas take turns.
        serving = [p for p in self._replicas.values() if p.state is ReplicaState.HEALTHY]
        if not serving:
            return []
        start = next(self._rotation) % len(serving)
        return serving[start:] + serving[:start]

    @property
    def _pipelines(self) -> list[Replica]:
        """Every replica, in the order they were added (the bench and tests reach in here)."""
        return list(self._replicas.values())

    def _id_of(self, pipeline: Replica) -> int | None:
        return next((i for i, p in self._replicas.items() if p is pipeline), None)

    # --- faults and recovery

    def _fault(self, pipeline: Replica, error: RunError) -> None:
        index = self._id_of(pipeline)
        if pipeline.state is not ReplicaState.HEALTHY or self._closed or index is None:
            return  # already out of the rotation: being recovered, or draining (never recovered)
        self._last_fault = error.message
        log.warning("replica %d leaves the rotation: %s", index, error.message)
        pipeline.state = ReplicaState.SUSPECT
        self._left_at[index] = time.monotonic()
        if pipeline.compiled is not None:
            pipeline.abandon(error.message)  # its graph is closed: no batch in it will answer
        hung = isinstance(error, StageTimeoutError)
        task = asyncio.create_task(self._recover(index, hung), name=f"recover-replica-{index}")
        self._recovery[index] = task

    async def _recover(self, index: int, hung: bool) -> None:
        try:
            how = await recover(
                self._replicas[index],
                index,
                self._layout,
                self.signature,
                hung=hung,
                closed=lambda: self._closed,
                failed=self._recovery_failing,
            )
        except Exception as exc:
            self._recovery_broke(index, exc)
            return
        if how is Recovered.PROBED:
            self._recoveries += 1
        elif how is Recovered.REBUILT:
            self._rebuilds += 1
        if how is not None:
            self._rejoin(index, how.value)

    def _recovery_broke(self, index: int, exc: Exception) -> None:
        """``recover`` retries every rebuild that fails, so what escapes it is a bug: logged
        once with its traceback and counted (``task_errors``); the replica stays out of the
        rotation, dead, and the batches held for it are refused with the reason instead of
        waiting for a recovery that no longer runs."""
        why = one_line(exc)
        log.exception(
            "replica %d: its recovery failed (%s); it stays out of the rotation", index, why
        )
        for hook in self.task_errors:
            hook("recovery")
        self._recovery.pop(index, None)
        self._last_fault = f"replica {index}'s recovery failed: {why}"  # what refusals now say
        replica = self._replicas.get(index)
        if replica is not None and replica.state is not ReplicaState.DRAINING:
            replica.state = ReplicaState.DEAD
        self._recovery_failing(why)

    def _recovery_failing(self, why: str) -> None:
        """A rebuild attempt failed: the replica is not expected back soon, so the batches held
        for it are refused (and new ones at once) until one rejoins."""
        self._recovery_failed = why
        self._release_held(f"its recovery failed: {why}")

    def _rejoin(self, index: int, why: str) -> None:
        self._recovery.pop(index, None)
        replica = self._replicas.get(index)
        if replica is None or replica.state is ReplicaState.DRAINING:
            return  # removed by a scale-down meanwhile
        log.warning("replica %d rejoins the rotation: %s", index, why)
        replica.clear_fault()
        replica.state = ReplicaState.HEALTHY
        left_at = self._left_at.pop(index, None)
        if left_at is not None:
            self._recovery_s = time.monotonic() - left_at
        self._recovery_failed = None
        self._release_held(None)

    # --- adding and removing replicas (issue 22)

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

    def health(self) -> Health:
        states = tuple(p.state.value for p in self._replicas.values())
        healthy = states.count(ReplicaState.HEALTHY.value)
        # With a replica healthy nothing is being waited for: no refusal to word (the version's
        # condition reads only ``ok`` then, on every request's look up).
        return Health(
            replicas=self.replicas,
            healthy=healthy,
            states=states,
            rebuilds=self._rebuilds,
            recoveries=self._recoveries,
            reason=self._last_fault,
            pending_reason=self.pending_reason() if self._waits_for else "",
            recovering=not healthy and self._recovering(),
            back_in_s=0.0 if healthy else self._unavailable().retry_after_s,
        )

    @property
    def replica_bundles(self) -> list[dict[str, float]]:
        """What one replica's placement group asks of the cluster: a bundle per stage."""
        return [dict(bundle) for bundle in self._layout.bundles]

    @property
    def inflight(self) -> tuple[int, ...]:
        """Batches handed to each replica and not answered yet."""
        return tuple(p.inflight for p in self._replicas.values())

    def batch_hard_timeout_s(self, rows: int) -> float:
        """The watchdog's limit now for a batch of ``rows`` rows."""
        return self._watchdog.limit_s(rows)

    # --- reports and shutdown

    async def describe(self) -> list[dict[str, Any]]:
        return await self._gather_from_actors("info")

    async def stats(self) -> list[dict[str, Any]]:
        return await self._gather_from_actors("stats")

    async def _gather_from_actors(self, method: str) -> list[dict[str, Any]]:
        """One answer per stage actor of the healthy replicas. An actor that died is left out
        and its replica recovered: the server's periodic stats poll is also its health check,
        so a replica that lost an actor between batches leaves the rotation before one fails."""
        pairs = [
            (i, p, k)
            for i, p in self._replicas.items()
            if p.state is ReplicaState.HEALTHY
            for k in range(len(p.actors))
        ]

        def ask(pipeline: Replica, stage: int) -> Any:
            # A guest stage's answer comes from its host's actor (shards.split.hosts).
            call, named = pipeline.call(stage, method)
            return call.remote(**named)

        results = await asyncio.gather(*(ask(p, k) for _, p, k in pairs), return_exceptions=True)
        answers = []
        for (index, pipeline, _), result in zip(pairs, results, strict=True):
            if isinstance(result, ray.exceptions.RayActorError):
                self._fault(pipeline, translate(result))
            elif isinstance(result, dict) and self._replicas.get(index) is pipeline:
                answers.append({"replica": index, **result})
        return answers

    async def close(self) -> None:
        self._replicas_at_close = len(self._replicas)
        self._closed = True
        self._release_held("the model's replicas are shut down")
        tasks = [*self._recovery.values(), *self._starting.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pipelines = list(self._replicas.values())
        self._replicas = {}
        # Ray's kill/remove calls block; off the event loop they cannot stall a shutdown, and
        # each close is bounded, so neither can a GCS that is gone.
        await asyncio.gather(*(asyncio.to_thread(p.close) for p in pipelines))
