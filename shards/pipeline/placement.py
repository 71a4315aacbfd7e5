"""Where a replica's stage actors run and how they start: what each stage asks of the cluster,
one placement group per replica with one bundle per actor (per stage, but where a tied table is
held once: part k's lookup and logits stages in one actor, ``Manifest.hosts``), the stage files
shipped to the nodes that lack them, an actor pinned to each bundle, and the wait until every
actor has warmed.

``Layout`` and ``ActorSpec`` keep what a replica was built from, so that
``shards.pipeline.recovery`` can build a failed one again the same way and
``ReplicaSet.add_replica`` one more (``new_replica`` places it, ``start_replica`` starts it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shards.actor.stage_actor import ShardActor
from shards.bundle.cache import DEFAULT_MAX_BYTES
from shards.bundle.format import Manifest
from shards.bundle.shipping import ShippedStage, ship_bundle, stages_off_node
from shards.bundle.tensor_routes import Route, Source, plan_routes
from shards.cluster import check_cluster_fits, cluster_has_gpus, placement_resources
from shards.cpu_plan import cpus_per_stage, intra_op_threads, machine_cores
from shards.errors import PipelineStartError, one_line
from shards.pipeline.options import PipelineOptions
from shards.pipeline.replica import Replica
from shards.pipeline.watchdog import Watchdog
from shards.signature import ModelSignature
from shards.split import GUEST_GROUP, DriverCombine

_RemoteShard = ray.remote(ShardActor)
# A host (a tied table held once: shards.split) runs its guests in a concurrency group of their
# own, one at a time each: batch n+1's lookup does not wait behind batch n's logits. Ray takes
# concurrency groups at the class only, not in ``.options()``.
_RemoteHost = ray.remote(concurrency_groups={GUEST_GROUP: 1})(ShardActor)  # type: ignore[call-overload]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActorSpec:
    """Everything a shard actor is started with, but its placement."""

    bundle_dir: Path
    cpus: float
    gpus: float
    batch_sizes: tuple[int, ...]
    imports: tuple[str, ...]
    simulate_device_ms: float | None
    stage_cache_dir: str | None
    max_restarts: int
    shipped: tuple[ShippedStage | None, ...]
    activation_dtype: str | None = None
    weight_dtype: str | None = None
    unsafe_deserialization: bool = False
    stage_cache_max_bytes: int = DEFAULT_MAX_BYTES
    gpu_memory_limit: bool = True
    # Each stage's host (``Manifest.hosts``): an actor per host, running its guests beside its
    # own stage (a tied table held once); empty: an actor per stage.
    hosts: tuple[int, ...] = ()

    @property
    def owners(self) -> list[int]:
        """The stages that have an actor of their own, in order: one bundle each."""
        return sorted(set(self.hosts))


@dataclass(frozen=True)
class Layout:
    """How a replica is built: kept so that a failed one can be built again."""

    routes: tuple[Route, ...]
    output_sources: dict[str, Source]
    bundles: list[dict[str, float]]
    actor: ActorSpec
    options: PipelineOptions
    depth: int
    # Model outputs the driver joins from a split layer's parts (shards.split).
    combines: tuple[DriverCombine, ...] = ()


def per_stage_resources(
    manifest: Manifest, given: tuple[dict[str, float], ...]
) -> tuple[dict[str, float], ...]:
    """``--stage-resources`` per stage: given one per stage (each part of a split layer its
    own, to put the parts on different nodes), or one per place in the pipeline (a split
    layer's parts each asking their place's entry), as the user counts stages before a cut."""
    places = manifest.places
    order = list(dict.fromkeys(places))
    if not given or len(given) == len(manifest.stages):
        return given
    if len(given) != len(order):
        raise ValueError(
            f"stage_resources has {len(given)} entries; the bundle has {len(manifest.stages)} "
            f"stages ({', '.join(s.name for s in manifest.stages)}) at {len(order)} places in "
            "the pipeline: give one entry per stage or one per place"
        )
    return tuple(given[order.index(p)] for p in places)


def place(bundles: list[dict[str, float]], strategy: str) -> PlacementGroup:
    return placement_group(bundles, strategy=strategy)


def spawn_actors(
    spec: ActorSpec, group: PlacementGroup, bundles: list[dict[str, float]]
) -> list[Any]:
    """An actor per bundle (per host stage), its guests with it; the actors by stage (a guest
    stage gets its host's actor)."""
    owners = spec.owners if spec.hosts else list(range(len(bundles)))
    actors = []
    for slot, (index, bundle) in enumerate(zip(owners, bundles, strict=True)):
        extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
        guests = [(g, spec.shipped[g] if spec.shipped else None) for g in _guests(spec, index)]
        remote = _RemoteHost if guests else _RemoteShard
        actor = remote.options(
            num_cpus=spec.cpus * (1 + len(guests)),
            num_gpus=spec.gpus,
            # Ray takes its memory resource as its own argument, never among ``resources``.
            memory=bundle.get("memory"),
            resources=extra or None,
            max_restarts=spec.max_restarts,
            # No transparent retries: a batch that killed a stage would kill it again on each
            # restart. The group retries a lost batch once, on another replica.
            max_task_retries=0,
            # One batch at a time keeps a shard's batches in order on its device.
            max_concurrency=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=slot
            ),
        ).remote(
            str(spec.bundle_dir),
            index,
            list(spec.batch_sizes),
            list(spec.imports),
            spec.simulate_device_ms,
            # A dataclass, not a bare ObjectRef: Ray would fetch a top-level ref eagerly.
            shipped=spec.shipped[index] if spec.shipped else None,
            stage_cache_dir=spec.stage_cache_dir,
            stage_cache_max_bytes=spec.stage_cache_max_bytes,
            activation_dtype=spec.activation_dtype,
            weight_dtype=spec.weight_dtype,
            unsafe_deserialization=spec.unsafe_deserialization,
            gpu_memory_limit=spec.gpu_memory_limit,
            guests=guests,
        )
        actors.append(actor)
    if not spec.hosts:
        return actors
    return [actors[owners.index(host)] for host in spec.hosts]


def _guests(spec: ActorSpec, host: int) -> list[int]:
    return [k for k, h in enumerate(spec.hosts) if h == host and k != host]


async def wait_groups(
    groups: list[PlacementGroup], bundles: list[dict[str, float]], timeout_s: float
) -> None:
    try:
        await asyncio.wait_for(asyncio.gather(*(g.ready() for g in groups)), timeout_s)
    except TimeoutError:
        raise PipelineStartError(
            f"placement groups for {len(groups)} replica(s) of bundles {bundles} not ready "
            f"after {timeout_s:g} s; resources available now: {ray.available_resources()}"
        ) from None


async def wait_actors(
    replicas: Sequence[Replica], timeout_s: float, first_replica: int = 0
) -> None:
    async def ready(replica: int, stage: int, actor: Any) -> None:
        try:
            await actor.info.remote()
        except ray.exceptions.RayActorError as exc:
            log.warning("shard actor %d/%d failed to start: %s", replica, stage, exc)
            raise PipelineStartError(
                f"shard actor for stage {stage} of replica {replica} failed to start: "
                f"{one_line(exc)}"
            ) from None

    waits = [
        ready(first_replica + r, k, a)
        for r, replica in enumerate(replicas)
        for k, a in enumerate(replica.actors)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*waits), timeout_s)
    except TimeoutError:
        raise PipelineStartError(
            f"shard actors not loaded and warmed after {timeout_s:g} s (ready_timeout_s)"
        ) from None


async def start_replicas(
    bundle_dir: Path, manifest: Manifest, options: PipelineOptions
) -> tuple[list[Replica], Layout]:
    """Place ``options.replicas`` replicas of the bundle, ship its stages to the nodes that lack
    them, start every stage actor and wait until each has loaded and warmed. Nothing is left
    behind when it raises."""
    routes, output_sources = plan_routes(manifest)
    gpus = options.gpus_per_shard
    if gpus is None:
        gpus = 1.0 if cluster_has_gpus() else 0.0
    # An actor per host stage (a tied table held once runs part k's logits in part k's lookup
    # actor: shards.split), a bundle each.
    hosts = tuple(manifest.hosts)
    owners = sorted(set(hosts))
    # CPUs are a stage's: a host asks its own and its guests' (its process runs them at once,
    # a TensorFlow thread each), GPUs an actor's (the device that holds the rows once).
    cpus = cpus_per_stage(
        options.cpus_per_shard,
        private_ray=options.private_ray,
        actors=len(manifest.stages) * options.replicas,
        cores=machine_cores(),
    )
    if options.cpus_per_shard is None:
        log.info(
            "%d stage(s) in %d actor(s) ask for %g CPU each (%d TensorFlow thread(s))",
            len(manifest.stages) * options.replicas,
            len(owners) * options.replicas,
            cpus,
            intra_op_threads(cpus),
        )
    # A CPU stage's memory plan is host memory: asked of Ray, so that models share the machine
    # by their plans (a GPU stage's plan is the device's, which Ray does not count).
    memory = [manifest.actor_peak_bytes(h) for h in owners] if not gpus else []
    extra = per_stage_resources(manifest, options.stage_resources)
    extra = tuple(extra[h] for h in owners) if extra else extra
    bundles = placement_resources(len(owners), cpus, gpus, extra, memory)
    for bundle, host in zip(bundles, owners, strict=True):
        if "CPU" in bundle:
            bundle["CPU"] *= hosts.count(host)
    check_cluster_fits(bundles, options.replicas, options.placement_strategy)
    replicas: list[Replica] = []
    try:
        groups = [place(bundles, options.placement_strategy) for _ in range(options.replicas)]
        for group in groups:
            replicas.append(Replica([], routes, output_sources, group, manifest.combines, hosts))
        await wait_groups(groups, bundles, options.ready_timeout_s)
        # Bundles are by actor: a stage is away where its host's bundle is.
        slots = stages_off_node(groups, ray.get_runtime_context().get_node_id())
        away = {k for k, h in enumerate(hosts) if owners.index(h) in slots}
        # Hashing and storing multi-GB stage files must not stall the event loop.
        shipped = await asyncio.to_thread(
            ship_bundle, bundle_dir, manifest, options.ship_stages, away
        )
        # The driver owns the shipped stage bytes: the spec holds the refs, which keeps
        # them in the object store for actors that restart or are rebuilt later.
        spec = ActorSpec(
            bundle_dir=bundle_dir,
            cpus=cpus,
            gpus=gpus,
            batch_sizes=options.batch_sizes,
            imports=options.imports,
            simulate_device_ms=options.simulate_device_ms,
            stage_cache_dir=options.stage_cache_dir,
            stage_cache_max_bytes=options.stage_cache_max_bytes,
            max_restarts=options.max_restarts,
            activation_dtype=options.activation_dtype,
            weight_dtype=options.weight_dtype,
            unsafe_deserialization=options.unsafe_deserialization,
            gpu_memory_limit=options.gpu_memory_limit,
            shipped=tuple(shipped),
            hosts=hosts if hosts != tuple(range(len(hosts))) else (),
        )
        for replica in replicas:
            replica.actors = spawn_actors(spec, replica.placement_group, bundles)
        await wait_actors(replicas, options.ready_timeout_s)
        # The parts of a split layer run side by side: they add no depth.
        depth = options.max_inflight_per_replica or manifest.depth + 1
        if options.compiled_graph:
            for replica in replicas:
                replica.compile(depth)
    except BaseException:
        for replica in replicas:
            replica.close()
        raise
    layout = Layout(routes, output_sources, bundles, spec, options, depth, manifest.combines)
    return replicas, layout


def new_replica(layout: Layout) -> Replica:
    """One more replica as ``layout`` builds them: its placement group asked for, no actors yet
    (``start_replica`` starts them once the group is placed)."""
    group = place(layout.bundles, layout.options.placement_strategy)
    return Replica(
        [], layout.routes, layout.output_sources, group, layout.combines, layout.actor.hosts
    )


async def start_replica(
    replica: Replica, layout: Layout, signature: ModelSignature, label: int
) -> None:
    """Start the actors of ``replica`` (from ``new_replica``) once its group is placed, and warm
    it with one batch. Raises ``PipelineStartError`` (its group not placed, or an actor not up,
    within ``ready_timeout_s``); the caller closes the replica then."""
    options = layout.options
    group = replica.placement_group
    await wait_groups([group], layout.bundles, options.ready_timeout_s)
    replica.actors = spawn_actors(layout.actor, group, layout.bundles)
    await wait_actors([replica], options.ready_timeout_s, first_replica=label)
    if options.compiled_graph:
        replica.compile(layout.depth)
    await warm(replica, signature, options.ready_timeout_s)


async def warm(replica: Replica, signature: ModelSignature, timeout_s: float) -> None:
    """Run one batch of one row of zeros through ``replica``."""
    inputs = {
        t.name: np.zeros((1, *(d or 1 for d in t.shape)), dtype=t.np_dtype)
        for t in signature.inputs
    }
    await replica.run(inputs, Watchdog(timeout_s))
