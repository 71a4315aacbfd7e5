"""R replicas of the model side by side (data parallel), kept healthy.

Each batch goes to the least-loaded healthy replica (``shards.replica.Pipeline``). A batch that
a replica fails to answer (a stage process died, or the batch ran past the watchdog's limit) is
retried once on another replica, and the replica leaves the rotation: it is probed (Ray restarts
a dead actor that has restarts left) or, when its actors are gone, rebuilt in the background with
a new placement group and actors, with backoff, and rejoins after one warm batch. A model that
raises on a batch is the batch's fault, not the replica's: that error goes back to the caller as a
``ModelError`` and the replica stays in. Every error that leaves is a one-line ``RunError``.
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

from shards.bundle import Manifest, read_manifest
from shards.errors import (
    InsufficientResourcesError,
    NoHealthyReplicaError,
    PipelineStartError,
    RunError,
    StageTimeoutError,
    one_line,
)
from shards.faults import Watchdog, is_replica_fault, translate
from shards.health import Health, ReplicaState
from shards.options import PipelineOptions
from shards.replica import (
    ActorSpec,
    Pipeline,
    place,
    release,
    spawn_actors,
    wait_actors,
    wait_groups,
)
from shards.runtime import (
    check_cluster_fits,
    cluster_has_gpus,
    cpus_per_stage,
    intra_op_threads,
    placement_resources,
)
from shards.shipping import ship_bundle, stages_off_node
from shards.signature import ModelSignature
from shards.tensor_routes import Route, Source, plan_routes

log = logging.getLogger(__name__)

__all__ = [
    "InsufficientResourcesError",
    "Pipeline",
    "PipelineGroup",
    "PipelineOptions",
    "PipelineStartError",
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


class PipelineGroup:
    """R replicas of the pipeline; each batch goes to the least-loaded healthy one."""

    def __init__(self, manifest: Manifest, pipelines: list[Pipeline], layout: _Layout) -> None:
        self.signature: ModelSignature = manifest.signature
        self.num_stages = len(manifest.stages)
        self.replicas = len(pipelines)
        self.on_gpu = layout.actor.gpus > 0
        self._pipelines = pipelines
        self._layout = layout
        self._rotation = itertools.cycle(range(len(pipelines)))
        self._watchdog = Watchdog(layout.options.batch_hard_timeout_s)
        # Set whenever a replica (re)joins the rotation; cleared when none is healthy.
        self._healthy = asyncio.Event()
        self._healthy.set()
        self._recovery: dict[int, asyncio.Task[None]] = {}
        self._rebuilds = 0
        self._recoveries = 0
        self._last_fault = ""
        self._closed = False

    @classmethod
    async def create(cls, bundle_dir: str | Path, options: PipelineOptions) -> PipelineGroup:
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
        pipelines: list[Pipeline] = []
        try:
            groups = [place(bundles, options.placement_strategy) for _ in range(options.replicas)]
            for group in groups:
                pipelines.append(Pipeline([], routes, output_sources, group))
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
        return cls(manifest, pipelines, layout)

    # --- running batches

    async def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.signature.input_names if n not in inputs]
        if missing:
            raise KeyError(
                f"inputs {missing} missing; model {self.signature.name!r} wants "
                f"{self.signature.input_names}, got {sorted(inputs)}"
            )
        tried: list[Pipeline] = []
        error: RunError | None = None
        attempts = victims = 0
        # The first try and one retry after a replica fault this batch may have caused; a batch
        # that only waited behind the cause is retried without counting, a few times at most.
        while attempts < 2 and victims <= self.replicas + 1:
            pipeline = await self._pick(tried)
            tried.append(pipeline)
            started = time.monotonic()
            try:
                outputs = await pipeline.run(inputs, self._watchdog.limit_s)
            except RunError as exc:
                error = exc
                if not is_replica_fault(error):
                    raise
                self._fault(pipeline, error)
                if error.victim:
                    victims += 1
                else:
                    attempts += 1
                continue
            self._watchdog.observe(time.monotonic() - started)
            return outputs
        assert error is not None
        # Twice lost: the batch itself may be what kills or hangs the stages, and a third
        # replica's restarts are not to be burnt on it.
        raise type(error)(f"{error.message}, on two replicas") from None

    run_batch = run

    async def _pick(self, tried: Sequence[Pipeline]) -> Pipeline:
        """The least-loaded healthy replica, one not tried yet if there is one; waits up to
        ``replica_wait_s`` when none is healthy."""
        deadline = time.monotonic() + self._layout.options.replica_wait_s
        while True:
            healthy = self._in_rotation()
            fresh = [p for p in healthy if p not in tried]
            candidates = fresh or healthy
            if candidates:
                return min(candidates, key=lambda p: p.inflight)
            self._healthy.clear()
            left = deadline - time.monotonic()
            try:
                if self._closed or left <= 0:
                    raise TimeoutError
                await asyncio.wait_for(self._healthy.wait(), left)
            except TimeoutError:
                raise NoHealthyReplicaError(
                    f"no healthy replica of {self.replicas}"
                    + (f" (last fault: {self._last_fault})" if self._last_fault else "")
                ) from None

    def _in_rotation(self) -> list[Pipeline]:
        # Rotating the scan start breaks ties, so idle replicas take turns.
        start = next(self._rotation)
        n = len(self._pipelines)
        ordered = (self._pipelines[(start + i) % n] for i in range(n))
        return [p for p in ordered if p.state is ReplicaState.HEALTHY]

    # --- faults and recovery

    def _fault(self, pipeline: Pipeline, error: RunError) -> None:
        self._last_fault = error.message
        if pipeline.state is not ReplicaState.HEALTHY or self._closed:
            return  # already out of the rotation, being recovered
        index = self._pipelines.index(pipeline)
        log.warning("replica %d leaves the rotation: %s", index, error.message)
        pipeline.state = ReplicaState.SUSPECT
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
        fresh = Pipeline([], layout.routes, layout.output_sources, group)
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

    async def _warm(self, pipeline: Pipeline) -> None:
        inputs = {
            t.name: np.zeros((1, *(d or 1 for d in t.shape)), dtype=t.np_dtype)
            for t in self.signature.inputs
        }
        await pipeline.run(inputs, self._layout.options.ready_timeout_s)

    def _rejoin(self, index: int, why: str) -> None:
        log.warning("replica %d rejoins the rotation: %s", index, why)
        self._pipelines[index].clear_fault()
        self._pipelines[index].state = ReplicaState.HEALTHY
        self._recovery.pop(index, None)
        self._healthy.set()

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
    def batch_hard_timeout_s(self) -> float:
        return self._watchdog.limit_s

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
        self._healthy.set()  # wake batches waiting for a replica: they fail now
        tasks = list(self._recovery.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pipelines, self._pipelines = self._pipelines, []
        # Ray's kill/remove calls block; off the event loop they cannot stall a shutdown, and
        # each close is bounded, so neither can a GCS that is gone.
        await asyncio.gather(*(asyncio.to_thread(p.close) for p in pipelines))
