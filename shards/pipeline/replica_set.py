"""R replicas of the model side by side (data parallel), kept healthy.

Each batch goes to the least-loaded healthy replica (``shards.pipeline.replica.Replica``). A batch
that
a replica fails to answer (a stage process died, or the batch ran past the watchdog's limit) is
retried once on another healthy replica, and the replica leaves the rotation: it is probed (Ray
restarts a dead actor that has restarts left) or, when its actors are gone, rebuilt in the
background with a new placement group and actors, with backoff, and rejoins after one warm batch.

Where no other replica is healthy (one replica, the default), nothing waits for the recovery: a
batch that hung fails at once with its ``StageTimeoutError``, and every other batch of the replica
(lost with it, or arriving while it recovers) with a ``NoHealthyReplicaError`` that says when to
try again. Retrying on the replica being rebuilt would cost a second watchdog period and a second
restart for a batch that may be what hangs it, and hold every other request meanwhile.

A model that raises on a batch is the batch's fault, not the replica's: that error goes back to
the caller as a ``ModelError`` and the replica stays in. Every error that leaves is a one-line
``RunError``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray

from shards.bundle.format import Manifest, read_manifest
from shards.bundle.shipping import ship_bundle, stages_off_node
from shards.cluster import (
    check_cluster_fits,
    cluster_has_gpus,
    cpus_per_stage,
    intra_op_threads,
    placement_resources,
)
from shards.errors import (
    InsufficientResourcesError,
    NoHealthyReplicaError,
    PipelineStartError,
    RunError,
    StageTimeoutError,
    one_line,
)
from shards.pipeline.faults import Watchdog, is_replica_fault, translate
from shards.pipeline.health import Health, ReplicaState
from shards.pipeline.options import PipelineOptions
from shards.pipeline.replica import (
    ActorSpec,
    Replica,
    place,
    release,
    spawn_actors,
    wait_actors,
    wait_groups,
)
from shards.pipeline.routes import Route, Source, plan_routes
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

# Pauses between attempts to rebuild a replica: doubling from the first to the last.
REBUILD_BACKOFF_S = (1.0, 60.0)


@dataclass(frozen=True)
class _Layout:
    """How a replica is built: kept so that a failed one can be built again."""

    routes: tuple[Route, ...]
    output_sources: dict[str, Source]
    bundles: list[dict[str, float]]
    actor: ActorSpec
    options: PipelineOptions
    depth: int


class ReplicaSet:
    """R replicas of the pipeline; each batch goes to the least-loaded healthy one."""

    def __init__(
        self,
        manifest: Manifest,
        pipelines: list[Replica],
        layout: _Layout,
        start_s: float = REBUILD_BACKOFF_S[0],
    ) -> None:
        self.signature: ModelSignature = manifest.signature
        self.num_stages = len(manifest.stages)
        self.replicas = len(pipelines)
        self.on_gpu = layout.actor.gpus > 0
        self._pipelines = pipelines
        self._layout = layout
        self._rotation = itertools.cycle(range(len(pipelines)))
        self._watchdog = Watchdog(layout.options.batch_hard_timeout_s)
        self._recovery: dict[int, asyncio.Task[None]] = {}
        # When each replica out of the rotation left it, and how long the last one took to come
        # back (the start-up's time until one has): what a refused request is told to wait.
        self._left_at: dict[int, float] = {}
        self._recovery_s = start_s
        self._rebuilds = 0
        self._recoveries = 0
        self._last_fault = ""
        self._closed = False

    @classmethod
    async def create(cls, bundle_dir: str | Path, options: PipelineOptions) -> ReplicaSet:
        began = time.monotonic()
        manifest = read_manifest(bundle_dir)
        routes, output_sources = plan_routes(manifest)
        gpus = options.gpus_per_shard
        if gpus is None:
            gpus = 1.0 if cluster_has_gpus() else 0.0
        cpus = cpus_per_stage(
            options.cpus_per_shard,
            private_ray=options.private_ray,
            actors=len(manifest.stages) * options.replicas,
            cluster_cpus=float(ray.cluster_resources().get("CPU", 0.0)),
        )
        if options.cpus_per_shard is None:
            log.info(
                "%d stage actor(s) ask for %g CPU each (%d TensorFlow thread(s))",
                len(manifest.stages) * options.replicas,
                cpus,
                intra_op_threads(cpus),
            )
        bundles = placement_resources(len(manifest.stages), cpus, gpus, options.stage_resources)
        check_cluster_fits(bundles, options.replicas, options.placement_strategy)
        pipelines: list[Replica] = []
        try:
            groups = [place(bundles, options.placement_strategy) for _ in range(options.replicas)]
            for group in groups:
                pipelines.append(Replica([], routes, output_sources, group))
            await wait_groups(groups, bundles, options.ready_timeout_s)
            away = stages_off_node(groups, ray.get_runtime_context().get_node_id())
            # Hashing and storing multi-GB stage files must not stall the event loop.
            shipped = await asyncio.to_thread(
                ship_bundle, Path(bundle_dir), manifest, options.ship_stages, away
            )
            # The driver owns the shipped stage bytes: the spec holds the refs, which keeps
            # them in the object store for actors that restart or are rebuilt later.
            spec = ActorSpec(
                bundle_dir=Path(bundle_dir),
                cpus=cpus,
                gpus=gpus,
                batch_sizes=options.batch_sizes,
                imports=options.imports,
                simulate_device_ms=options.simulate_device_ms,
                stage_cache_dir=options.stage_cache_dir,
                max_restarts=options.max_restarts,
                activation_dtype=options.activation_dtype,
                weight_dtype=options.weight_dtype,
                unsafe_deserialization=options.unsafe_deserialization,
                shipped=tuple(shipped),
            )
            for pipeline in pipelines:
                pipeline.actors = spawn_actors(spec, pipeline.placement_group, bundles)
            await wait_actors(pipelines, options.ready_timeout_s)
            depth = options.max_inflight_per_replica or len(manifest.stages) + 1
            if options.compiled_graph:
                for pipeline in pipelines:
                    pipeline.compile(depth)
        except BaseException:
            for pipeline in pipelines:
                pipeline.close()
            raise
        layout = _Layout(routes, output_sources, bundles, spec, options, depth)
        return cls(manifest, pipelines, layout, start_s=time.monotonic() - began)

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
            try:
                return await pipeline.run(inputs, self._watchdog)
            except RunError as error:
                if not is_replica_fault(error):
                    raise
                self._fault(pipeline, error)
                if error.victim:
                    victims += 1
                else:
                    attempts += 1
                if not self._in_rotation():
                    if isinstance(error, StageTimeoutError) and not error.victim:
                        raise
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
            raise self._unavailable()
        return min(candidates, key=lambda p: p.inflight)

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
        start = next(self._rotation)
        n = len(self._pipelines)
        ordered = (self._pipelines[(start + i) % n] for i in range(n))
        return [p for p in ordered if p.state is ReplicaState.HEALTHY]

    # --- faults and recovery

    def _fault(self, pipeline: Replica, error: RunError) -> None:
        if pipeline.state is not ReplicaState.HEALTHY or self._closed:
            return  # already out of the rotation, being recovered
        self._last_fault = error.message
        index = self._pipelines.index(pipeline)
        log.warning("replica %d leaves the rotation: %s", index, error.message)
        pipeline.state = ReplicaState.SUSPECT
        self._left_at[index] = time.monotonic()
        hung = isinstance(error, StageTimeoutError)
        task = asyncio.create_task(self._recover(index, hung), name=f"recover-replica-{index}")
        self._recovery[index] = task

    async def _recover(self, index: int, hung: bool) -> None:
        pipeline = self._pipelines[index]
        options = self._layout.options
        probe_s = min(options.ready_timeout_s, 120.0)
        if pipeline.compiled is None:
            if hung:
                await asyncio.to_thread(pipeline.kill_actors)
            try:
                await pipeline.probe(probe_s)
                await self._warm(pipeline)
                self._rejoin(index, "its stage actors answer again")
                self._recoveries += 1
                return
            except Exception as exc:
                log.warning("replica %d: probe failed (%s); rebuilding it", index, one_line(exc))
        # A compiled graph is closed by an actor's death: the replica is always rebuilt.
        pipeline.state = ReplicaState.DEAD
        pause = REBUILD_BACKOFF_S[0]
        while not self._closed:
            try:
                await self._rebuild(index)
                self._rebuilds += 1
                self._rejoin(index, "rebuilt")
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "replica %d: rebuild failed (%s); next try in %g s",
                    index,
                    one_line(exc),
                    pause,
                )
                await asyncio.sleep(pause)
                pause = min(pause * 2, REBUILD_BACKOFF_S[1])

    async def _rebuild(self, index: int) -> None:
        layout = self._layout
        options = layout.options
        old = self._pipelines[index]
        # The old actors and group go first: on a full cluster the new ones need their place.
        await asyncio.to_thread(release, old.actors, old.placement_group, old.compiled)
        old.actors, old.compiled = [], None
        group = place(layout.bundles, options.placement_strategy)
        fresh = Replica([], layout.routes, layout.output_sources, group)
        try:
            await wait_groups([group], layout.bundles, options.ready_timeout_s)
            fresh.actors = spawn_actors(layout.actor, group, layout.bundles)
            await wait_actors([fresh], options.ready_timeout_s, first_replica=index)
            if options.compiled_graph:
                fresh.compile(layout.depth)
            await self._warm(fresh)
        except BaseException:
            await asyncio.to_thread(fresh.close)
            raise
        old.swap(fresh)

    async def _warm(self, pipeline: Replica) -> None:
        inputs = {
            t.name: np.zeros((1, *(d or 1 for d in t.shape)), dtype=t.np_dtype)
            for t in self.signature.inputs
        }
        await pipeline.run(inputs, Watchdog(self._layout.options.ready_timeout_s))

    def _rejoin(self, index: int, why: str) -> None:
        log.warning("replica %d rejoins the rotation: %s", index, why)
        self._pipelines[index].clear_fault()
        self._pipelines[index].state = ReplicaState.HEALTHY
        self._recovery.pop(index, None)
        left_at = self._left_at.pop(index, None)
        if left_at is not None:
            self._recovery_s = time.monotonic() - left_at

    def health(self) -> Health:
        states = tuple(p.state.value for p in self._pipelines)
        return Health(
            replicas=self.replicas,
            healthy=states.count(ReplicaState.HEALTHY.value),
            states=states,
            rebuilds=self._rebuilds,
            recoveries=self._recoveries,
            reason=self._last_fault,
        )

    @property
    def inflight(self) -> tuple[int, ...]:
        """Batches handed to each replica and not answered yet."""
        return tuple(p.inflight for p in self._pipelines)

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
            (p, a) for p in self._pipelines if p.state is ReplicaState.HEALTHY for a in p.actors
        ]
        results = await asyncio.gather(
            *(getattr(a, method).remote() for _, a in pairs), return_exceptions=True
        )
        answers = []
        for (pipeline, _), result in zip(pairs, results, strict=True):
            if isinstance(result, ray.exceptions.RayActorError):
                self._fault(pipeline, translate(result))
            elif isinstance(result, dict) and pipeline in self._pipelines:
                answers.append({"replica": self._pipelines.index(pipeline), **result})
        return answers

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._recovery.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pipelines, self._pipelines = self._pipelines, []
        # Ray's kill/remove calls block; off the event loop they cannot stall a shutdown, and
        # each close is bounded, so neither can a GCS that is gone.
        await asyncio.gather(*(asyncio.to_thread(p.close) for p in pipelines))
