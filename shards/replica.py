"""One replica of the model: K stage actors in one placement group, chained through ObjectRefs.

A batch enters stage 0 and the refs are chained actor to actor, so the driver never waits between
stages: while stage 1 computes batch n, stage 0 already computes batch n+1. ``spawn_replicas``
places and starts replicas; ``shards.pipeline.PipelineGroup`` routes batches over them and
rebuilds one that fails.
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
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shards.actor import ShardActor
from shards.compiled import CompiledStages
from shards.errors import PipelineStartError, StageTimeoutError, one_line
from shards.faults import is_replica_fault, translate
from shards.health import ReplicaState
from shards.runtime import run_bounded
from shards.shipping import ShippedStage
from shards.tensor_routes import Route, Source, request_readers

_RemoteShard = ray.remote(ShardActor)
log = logging.getLogger(__name__)

# Killing actors and removing a placement group take milliseconds on a live cluster; past this a
# shutdown stops waiting for a GCS that is gone.
CLOSE_TIMEOUT_S = 10.0


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


class Pipeline:
    """One replica: K stage actors chained through ObjectRefs, and its health."""

    def __init__(
        self,
        actors: Sequence[Any],
        routes: tuple[Route, ...],
        output_sources: dict[str, Source],
        group: PlacementGroup,
    ) -> None:
        self.actors = list(actors)
        self.placement_group = group
        self.inflight = 0
        self.state = ReplicaState.HEALTHY
        self._closed = False
        # Batches in flight by arrival; the oldest one when a fault hit is its suspect.
        self._seq = itertools.count()
        self._running: set[int] = set()
        self._fault_seq: int | None = None
        self._routes = routes
        self._output_sources = output_sources
        self._request_readers = request_readers(routes)
        # Only the model outputs that a stage makes are awaited; the rest of a stage's outputs
        # go from stage to stage and never come back to the driver.
        self._awaited = {n: s for n, s in output_sources.items() if not s.from_request}
        self.compiled: CompiledStages | None = None

    def compile(self, max_inflight: int) -> None:
        """Switch this replica to a compiled graph over its actors (inside the event loop)."""
        self.compiled = CompiledStages(self.actors, self._routes, self._awaited, max_inflight)

    async def run(
        self, inputs: dict[str, np.ndarray], timeout_s: float | None = None
    ) -> dict[str, np.ndarray]:
        """The model outputs for one batch; a one-line ``RunError`` when it fails, a
        ``StageTimeoutError`` past ``timeout_s``.

        A replica fault fails every batch in flight on the replica, but only the oldest of them
        can be its cause: stages run batches in order, so the younger ones were waiting behind
        it. Those come out with ``victim`` set, and their retry is not counted against them.
        """
        self.inflight += 1
        seq = next(self._seq)
        self._running.add(seq)
        try:
            return await asyncio.wait_for(self._run(inputs), timeout_s)
        except Exception as exc:
            error = translate(
                StageTimeoutError(f"the batch ran past the watchdog's limit of {timeout_s:.3g} s")
                if isinstance(exc, TimeoutError) and not isinstance(exc, ray.exceptions.RayError)
                else exc
            )
            if is_replica_fault(error):
                if self._fault_seq is None:
                    self._fault_seq = min(self._running)
                error.victim = seq != self._fault_seq
            raise error from None
        finally:
            self._running.discard(seq)
            self.inflight -= 1

    def clear_fault(self) -> None:
        """Back in the rotation: the next fault has a suspect of its own."""
        self._fault_seq = None

    async def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.compiled is not None:
            return self._outputs(inputs, await self.compiled.run(inputs))
        # A request tensor that several stages read goes into the object store once.
        request = {
            name: ray.put(inputs[name]) if readers > 1 else inputs[name]
            for name, readers in self._request_readers.items()
        }
        # Top-level refs as arguments: Ray hands each stage the arrays themselves, fetched from
        # the stage that made them.
        made: list[list[Any]] = []
        for actor, route in zip(self.actors, self._routes, strict=True):
            args = [
                request[s.name] if s.from_request else made[s.stage][s.index] for s in route.inputs
            ]
            out = actor.forward.options(num_returns=route.num_returns).remote(*args)
            made.append([out] if route.num_returns == 1 else list(out))
        refs = [made[s.stage][s.index] for s in self._awaited.values()]
        values = await asyncio.gather(*refs)
        return self._outputs(inputs, dict(zip(self._awaited, values, strict=True)))

    def _outputs(
        self, inputs: dict[str, np.ndarray], made: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        return {
            name: inputs[name] if src.from_request else made[name]
            for name, src in self._output_sources.items()
        }

    async def probe(self, timeout_s: float) -> None:
        """Return once every stage actor answers (Ray restarts one that died with restarts
        left, and it answers once reloaded); raise if one is gone for good or too slow."""
        deadline = time.monotonic() + timeout_s

        async def answer(actor: Any) -> None:
            while True:
                try:
                    await actor.info.remote()
                    return
                except ray.exceptions.ActorUnavailableError:
                    # Restarting; ask again until it is back or the probe's time is up.
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)

        await asyncio.wait_for(asyncio.gather(*(answer(a) for a in self.actors)), timeout_s)

    def kill_actors(self) -> None:
        """Stop every stage at once, running task included, and let Ray restart them.

        ``ray.cancel`` does not interrupt a running task of a regular actor; a kill does.
        """
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=False)
            except Exception:
                log.warning("killing a shard actor failed", exc_info=True)

    def swap(self, fresh: Pipeline) -> tuple[list[Any], PlacementGroup, CompiledStages | None]:
        """Take over ``fresh``'s actors; return the old ones for ``release``."""
        self.clear_fault()
        old = (self.actors, self.placement_group, self.compiled)
        self.actors, self.placement_group, self.compiled = (
            fresh.actors,
            fresh.placement_group,
            fresh.compiled,
        )
        return old

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Kill the actors and free the placement group; never raises, never waits longer than
        ``timeout_s``. False when Ray did not answer in time. A second call does nothing."""
        if self._closed:
            return True
        self._closed = True
        return release(self.actors, self.placement_group, self.compiled, timeout_s)


def release(
    actors: Sequence[Any],
    group: PlacementGroup,
    compiled: CompiledStages | None,
    timeout_s: float = CLOSE_TIMEOUT_S,
) -> bool:
    """Tear down a graph, kill actors and free a placement group, bounded in time."""
    if not ray.is_initialized():
        log.info("Ray is already shut down; the pipeline's actors went with it")
        return True

    def run() -> None:
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

    return run_bounded(run, timeout_s, f"closing a pipeline of {len(actors)} shard actors")


def place(bundles: list[dict[str, float]], strategy: str) -> PlacementGroup:
    return placement_group(bundles, strategy=strategy)


def spawn_actors(
    spec: ActorSpec, group: PlacementGroup, bundles: list[dict[str, float]]
) -> list[Any]:
    actors = []
    for index, bundle in enumerate(bundles):
        extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        actor = _RemoteShard.options(
            num_cpus=spec.cpus,
            num_gpus=spec.gpus,
            resources=extra or None,
            max_restarts=spec.max_restarts,
            # No transparent retries: a batch that killed a stage would kill it again on each
            # restart. The group retries a lost batch once, on another replica.
            max_task_retries=0,
            # One batch at a time keeps a shard's batches in order on its device.
            max_concurrency=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index
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
            activation_dtype=spec.activation_dtype,
            weight_dtype=spec.weight_dtype,
            unsafe_deserialization=spec.unsafe_deserialization,
        )
        actors.append(actor)
    return actors


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
    pipelines: Sequence[Pipeline], timeout_s: float, first_replica: int = 0
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
        for r, p in enumerate(pipelines)
        for k, a in enumerate(p.actors)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*waits), timeout_s)
    except TimeoutError:
        raise PipelineStartError(
            f"shard actors not loaded and warmed after {timeout_s:g} s (ready_timeout_s)"
        ) from None
