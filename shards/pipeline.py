"""Pipelines of shard actors: K stage actors per replica, R replicas side by side.

A batch enters stage 0 and the ObjectRefs are chained actor to actor, so the driver never waits
between stages: while stage 1 computes batch n, stage 0 already computes batch n+1. Each
replica's actors share one placement group. Stages placed on nodes other than the driver's get
their file through the object store (``shards.shipping``), so no shared filesystem is needed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shards.actor import ShardActor
from shards.bundle import Manifest, read_manifest
from shards.compiled import CompiledStages
from shards.routes import MODEL_INPUT, Route, plan_routes
from shards.runtime import (
    PLACEMENT_STRATEGIES,
    InsufficientResourcesError,
    check_cluster_fits,
    cluster_has_gpus,
    run_bounded,
    stage_bundles,
)
from shards.shipping import ShippedStage, ship_bundle, stages_off_node
from shards.signature import ModelSignature

_RemoteShard = ray.remote(ShardActor)
log = logging.getLogger(__name__)

__all__ = [
    "InsufficientResourcesError",
    "Pipeline",
    "PipelineGroup",
    "PipelineOptions",
    "PipelineStartError",
    "plan_routes",
    "stage_bundles",
]

# Killing actors and removing a placement group take milliseconds on a live cluster; past this a
# shutdown stops waiting for a GCS that is gone.
CLOSE_TIMEOUT_S = 10.0


class PipelineStartError(RuntimeError):
    """A placement group or a shard actor did not come up."""


@dataclass(frozen=True)
class PipelineOptions:
    replicas: int = 1
    gpus_per_shard: float | None = None
    cpus_per_shard: float = 1.0
    placement_strategy: str = "PACK"
    stage_resources: tuple[dict[str, float], ...] = ()
    batch_sizes: tuple[int, ...] = (1,)
    imports: tuple[str, ...] = ()
    max_restarts: int = 3
    max_task_retries: int = 3
    simulate_device_ms: float | None = None
    ready_timeout_s: float = 300.0
    # None: ship the stage files placed on nodes other than the driver's; True: ship every
    # stage (an actor still loads its node's copy when it matches); False: never ship.
    ship_stages: bool | None = None
    stage_cache_dir: str | None = None
    # Run each replica as a Ray compiled graph (shards.compiled): less latency per batch, a
    # spinning core per stage actor, no reattaching a restarted actor.
    compiled_graph: bool = False
    # The compiled graph's capacity per replica; None: stages + 1 (the batcher's default share).
    # More batches than this wait for a free place rather than fail.
    max_inflight_per_replica: int | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.gpus_per_shard is not None and self.gpus_per_shard < 0:
            raise ValueError(f"gpus_per_shard must be >= 0 or None, got {self.gpus_per_shard}")
        if self.cpus_per_shard < 0:
            raise ValueError(f"cpus_per_shard must be >= 0, got {self.cpus_per_shard}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                f"got {self.placement_strategy!r}"
            )
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be integers >= 1, got {self.batch_sizes}")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")
        if self.max_inflight_per_replica is not None and self.max_inflight_per_replica < 1:
            raise ValueError(
                f"max_inflight_per_replica must be >= 1, got {self.max_inflight_per_replica}"
            )


class Pipeline:
    """One replica: K stage actors chained through ObjectRefs."""

    def __init__(
        self,
        actors: Sequence[Any],
        routes: tuple[Route, ...],
        output_sources: dict[str, int],
        group: PlacementGroup,
    ) -> None:
        self.actors = list(actors)
        self.placement_group = group
        self.inflight = 0
        self._closed = False
        self._routes = routes
        self._output_sources = output_sources
        self._request_readers = sum(r.needs_request for r in routes)
        self._output_stages = sorted({s for s in output_sources.values() if s != MODEL_INPUT})
        self.compiled: CompiledStages | None = None

    def compile(self, max_inflight: int) -> None:
        """Switch this replica to a compiled graph over its actors (inside the event loop)."""
        self.compiled = CompiledStages(self.actors, self._routes, self._output_stages, max_inflight)

    async def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.inflight += 1
        try:
            if self.compiled is not None:
                results = await self.compiled.run(inputs)
                return self._outputs(inputs, results)
            # One copy in the object store instead of one per stage that reads the request.
            request: Any = ray.put(inputs) if self._request_readers > 1 else inputs
            refs: list[Any] = []
            for actor, route in zip(self.actors, self._routes, strict=True):
                parts = [request] if route.needs_request else []
                parts += [refs[j] for j in route.from_stages]
                refs.append(actor.forward.remote(*parts))
            stages = self._output_stages
            results = dict(
                zip(stages, await asyncio.gather(*(refs[s] for s in stages)), strict=True)
            )
            return self._outputs(inputs, results)
        finally:
            self.inflight -= 1

    def _outputs(
        self, inputs: dict[str, np.ndarray], results: dict[int, dict[str, np.ndarray]]
    ) -> dict[str, np.ndarray]:
        return {
            name: inputs[name] if src == MODEL_INPUT else results[src][name]
            for name, src in self._output_sources.items()
        }

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Kill the actors and free the placement group; never raises, never waits longer than
        ``timeout_s``. False when Ray did not answer in time. A second call does nothing."""
        if self._closed:
            return True
        self._closed = True
        if not ray.is_initialized():
            log.info("Ray is already shut down; the pipeline's actors went with it")
            return True
        actors, group, compiled = self.actors, self.placement_group, self.compiled

        def release() -> None:
            if compiled is not None:
                try:
                    compiled.teardown()
                except Exception:
                    log.warning("tearing down the compiled graph failed", exc_info=True)
            for actor in actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:
                    log.warning("killing shard actor %s failed", actor, exc_info=True)
            remove_placement_group(group)

        return run_bounded(release, timeout_s, f"closing a pipeline of {len(actors)} shard actors")


class PipelineGroup:
    """R replicas of the pipeline (data parallel); each batch goes to the least-loaded one."""

    def __init__(
        self,
        manifest: Manifest,
        pipelines: list[Pipeline],
        shipped: Sequence[ShippedStage | None] = (),
    ) -> None:
        self.signature: ModelSignature = manifest.signature
        self.num_stages = len(manifest.stages)
        self.replicas = len(pipelines)
        self._pipelines = pipelines
        self._rotation = itertools.cycle(range(len(pipelines)))
        # The driver owns the shipped stage bytes: holding the refs keeps them in the object
        # store for actors that restart later, possibly on another node.
        self._shipped = list(shipped)

    @classmethod
    async def create(cls, bundle_dir: str | Path, options: PipelineOptions) -> PipelineGroup:
        manifest = read_manifest(bundle_dir)
        routes, output_sources = plan_routes(manifest)
        gpus = options.gpus_per_shard
        if gpus is None:
            gpus = 1.0 if cluster_has_gpus() else 0.0
        bundles = stage_bundles(
            len(manifest.stages), options.cpus_per_shard, gpus, options.stage_resources
        )
        check_cluster_fits(bundles, options.replicas, options.placement_strategy)
        pipelines: list[Pipeline] = []
        try:
            groups = [
                placement_group(bundles, strategy=options.placement_strategy)
                for _ in range(options.replicas)
            ]
            for group in groups:
                pipelines.append(Pipeline([], routes, output_sources, group))
            await _wait_groups(groups, bundles, options.ready_timeout_s)
            away = stages_off_node(groups, ray.get_runtime_context().get_node_id())
            # Hashing and storing multi-GB stage files must not stall the event loop.
            shipped = await asyncio.to_thread(
                ship_bundle, Path(bundle_dir), manifest, options.ship_stages, away
            )
            for pipeline in pipelines:
                pipeline.actors = _spawn_actors(
                    Path(bundle_dir), pipeline.placement_group, bundles, gpus, options, shipped
                )
            await _wait_actors(pipelines, options.ready_timeout_s)
            if options.compiled_graph:
                depth = options.max_inflight_per_replica or len(manifest.stages) + 1
                for pipeline in pipelines:
                    pipeline.compile(depth)
        except BaseException:
            for pipeline in pipelines:
                pipeline.close()
            raise
        return cls(manifest, pipelines, shipped)

    def _least_loaded(self) -> Pipeline:
        # Rotating the scan start breaks ties, so idle replicas take turns.
        start = next(self._rotation)
        n = len(self._pipelines)
        return min((self._pipelines[(start + i) % n] for i in range(n)), key=lambda p: p.inflight)

    async def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.signature.input_names if n not in inputs]
        if missing:
            raise KeyError(
                f"inputs {missing} missing; model {self.signature.name!r} wants "
                f"{self.signature.input_names}, got {sorted(inputs)}"
            )
        return await self._least_loaded().run(inputs)

    run_batch = run

    async def describe(self) -> list[dict[str, Any]]:
        return await self._gather_from_actors("info")

    async def stats(self) -> list[dict[str, Any]]:
        return await self._gather_from_actors("stats")

    async def _gather_from_actors(self, method: str) -> list[dict[str, Any]]:
        pairs = [(r, a) for r, p in enumerate(self._pipelines) for a in p.actors]
        results = await asyncio.gather(*(getattr(a, method).remote() for _, a in pairs))
        return [{"replica": r, **res} for (r, _), res in zip(pairs, results, strict=True)]

    async def close(self) -> None:
        pipelines, self._pipelines = self._pipelines, []
        # Ray's kill/remove calls block; off the event loop they cannot stall a shutdown, and
        # each close is bounded, so neither can a GCS that is gone.
        await asyncio.gather(*(asyncio.to_thread(p.close) for p in pipelines))
        self._shipped = []


def _spawn_actors(
    bundle_dir: Path,
    group: PlacementGroup,
    bundles: list[dict[str, float]],
    gpus: float,
    options: PipelineOptions,
    shipped: Sequence[ShippedStage | None],
) -> list[Any]:
    actors = []
    for index, bundle in enumerate(bundles):
        extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        actor = _RemoteShard.options(
            num_cpus=options.cpus_per_shard,
            num_gpus=gpus,
            resources=extra or None,
            max_restarts=options.max_restarts,
            max_task_retries=options.max_task_retries,
            # One batch at a time keeps a shard's batches in order on its device.
            max_concurrency=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index
            ),
        ).remote(
            str(bundle_dir),
            index,
            list(options.batch_sizes),
            list(options.imports),
            options.simulate_device_ms,
            # A dataclass, not a bare ObjectRef: Ray would fetch a top-level ref eagerly.
            shipped=shipped[index],
            stage_cache_dir=options.stage_cache_dir,
        )
        actors.append(actor)
    return actors


async def _wait_groups(
    groups: list[PlacementGroup], bundles: list[dict[str, float]], timeout_s: float
) -> None:
    try:
        await asyncio.wait_for(asyncio.gather(*(g.ready() for g in groups)), timeout_s)
    except TimeoutError:
        raise PipelineStartError(
            f"placement groups for {len(groups)} replica(s) of bundles {bundles} not ready "
            f"after {timeout_s:g} s; resources available now: {ray.available_resources()}"
        ) from None


async def _wait_actors(pipelines: list[Pipeline], timeout_s: float) -> None:
    async def ready(replica: int, stage: int, actor: Any) -> None:
        try:
            await actor.info.remote()
        except ray.exceptions.RayActorError as exc:
            raise PipelineStartError(
                f"shard actor for stage {stage} of replica {replica} failed to start: {exc}"
            ) from None

    waits = [ready(r, k, a) for r, p in enumerate(pipelines) for k, a in enumerate(p.actors)]
    try:
        await asyncio.wait_for(asyncio.gather(*waits), timeout_s)
    except TimeoutError:
        raise PipelineStartError(
            f"shard actors not loaded and warmed after {timeout_s:g} s (ready_timeout_s)"
        ) from None
