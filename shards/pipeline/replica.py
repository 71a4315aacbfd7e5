"""One replica of the model: K stage actors in one placement group, chained through ObjectRefs.

A batch enters stage 0 and the refs are chained actor to actor, so the driver never waits between
stages: while stage 1 computes batch n, stage 0 already computes batch n+1. ``spawn_replicas``
places and starts replicas; ``shards.pipeline.replica_set.ReplicaSet`` routes batches over them and
rebuilds one that fails.

The watchdog times a batch from when the first stage starts it, not from when it was handed to
the replica: the time it queued behind other batches (in the compiled graph's semaphore, in the
actors' queues) is theirs, and counting it would let a load spike get a healthy replica killed.
Stages take batches in order, so a batch starts in stage 0 once the batch before it has left
stage 0. The driver learns that when stage 0's output exists, from the task's reply: no fetch
and no extra call per batch (measured: driver CPU per batch unchanged within noise; a callback
on a tiny extra return, fetched, cost 0.1-0.3 ms). A compiled graph's outputs come back all at
once, so there a batch starts when the one before it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shards.actor.stage_actor import ShardActor
from shards.bundle.shipping import ShippedStage
from shards.cluster import run_bounded
from shards.errors import PipelineStartError, StageTimeoutError, one_line
from shards.pipeline.compiled import CompiledStages
from shards.pipeline.faults import Watchdog, is_replica_fault, translate
from shards.pipeline.health import ReplicaState
from shards.pipeline.routes import Route, Source, request_readers

_RemoteShard = ray.remote(ShardActor)
# Ray 2.60's way to learn that a task's return exists without fetching it (stage 0's outputs
# stay on its node). Without it a batch's clock starts when the batch before it is done.
_ON_READY = hasattr(ray.ObjectRef, "_on_ready")
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


class Replica:
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
        # Set by the last batch handed to stage 0 once it has left stage 0.
        self._first_stage_tail: asyncio.Future[None] | None = None
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
        self, inputs: dict[str, np.ndarray], watchdog: Watchdog | None = None
    ) -> dict[str, np.ndarray]:
        """The model outputs for one batch; a one-line ``RunError`` when it fails, a
        ``StageTimeoutError`` when it runs past ``watchdog``'s limit for its size, timed from
        when stage 0 starts it. A batch that completes is observed by ``watchdog``.

        A replica fault fails every batch in flight on the replica, but only the oldest of them
        can be its cause: stages run batches in order, so the younger ones were waiting behind
        it. Those come out with ``victim`` set, and their retry is not counted against them.
        """
        self.inflight += 1
        seq = next(self._seq)
        self._running.add(seq)
        rows = _rows(inputs)
        clock: _Clock | None = None
        try:
            async with asyncio.timeout(None) as scope:
                clock = _Clock(scope, lambda: watchdog.limit_s(rows) if watchdog else None)
                outputs = await self._run(inputs, clock)
            if watchdog is not None and clock.started is not None:
                watchdog.observe(rows, clock.elapsed_s())
            return outputs
        except Exception as exc:
            timed_out = isinstance(exc, TimeoutError) and not isinstance(
                exc, ray.exceptions.RayError
            )
            limit = clock.limit_s if clock is not None else None
            error = translate(
                StageTimeoutError(f"the batch ran past the watchdog's limit of {limit:.3g} s")
                if timed_out and limit is not None
                else exc
            )
            if is_replica_fault(error):
                if self._fault_seq is None:
                    self._fault_seq = min(self._running)
                error.victim = seq != self._fault_seq
            raise error from None
        finally:
            if clock is not None:
                clock.stop()
            self._running.discard(seq)
            self.inflight -= 1

    def clear_fault(self) -> None:
        """Back in the rotation: the next fault has a suspect of its own."""
        self._fault_seq = None

    def _enter_first_stage(self, clock: _Clock) -> asyncio.Future[None]:
        """Queue a batch at stage 0: its clock starts at once when no batch handed over before
        it is still in stage 0, else when the one before it leaves. The caller sets the future
        returned when this batch leaves stage 0 (each batch sets it at the latest when it ends,
        so a lost marker cannot hold the next batch's clock)."""
        left: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ahead, self._first_stage_tail = self._first_stage_tail, left
        clock.left = left
        if ahead is None or ahead.done():
            clock.start()
        else:
            ahead.add_done_callback(lambda _: clock.start())
        return left

    async def _run(self, inputs: dict[str, np.ndarray], clock: _Clock) -> dict[str, np.ndarray]:
        if self.compiled is not None:
            outputs = await self.compiled.run(inputs, lambda: self._enter_first_stage(clock))
            return self._outputs(inputs, outputs)
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
        # No await since stage 0 was called: batches enter in the order of their stage-0 calls.
        left = self._enter_first_stage(clock)
        if _ON_READY:
            _set_when_ready(made[0][0], left)
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

        # asyncio.timeout, not wait_for: a probe cancelled by a shutdown leaves no gather whose
        # exception nobody retrieved.
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(answer(a) for a in self.actors))

    def kill_actors(self) -> None:
        """Stop every stage at once, running task included, and let Ray restart them.

        ``ray.cancel`` does not interrupt a running task of a regular actor; a kill does.
        """
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=False)
            except Exception:
                log.warning("killing a shard actor failed", exc_info=True)

    def swap(self, fresh: Replica) -> tuple[list[Any], PlacementGroup, CompiledStages | None]:
        """Take over ``fresh``'s actors; return the old ones for ``release``."""
        self.clear_fault()
        self._first_stage_tail = None  # new actors: no batch of the old ones is ahead
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


def _rows(inputs: dict[str, np.ndarray]) -> int:
    return len(next(iter(inputs.values()))) if inputs else 0


def _set_when_ready(ref: Any, left: asyncio.Future[None]) -> None:
    """Set ``left`` once ``ref`` exists (or its task failed), without fetching it."""
    loop = asyncio.get_running_loop()

    def ready(_: BaseException | None) -> None:
        # On one of Ray's threads; the loop may be closed by now (a shutdown).
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_set, left)

    ref._on_ready(ready)


def _set(left: asyncio.Future[None]) -> None:
    if not left.done():
        left.set_result(None)


class _Clock:
    """One batch's watchdog: no limit while the batch waits for stage 0, then its size's limit
    from when stage 0 starts it (``scope`` is the ``asyncio.timeout`` around the batch)."""

    def __init__(self, scope: asyncio.Timeout, limit_s: Callable[[], float | None]) -> None:
        self._scope = scope
        self._limit_s = limit_s
        self.limit_s: float | None = None
        self.started: float | None = None
        self.left: asyncio.Future[None] | None = None
        self._stopped = False

    def start(self) -> None:
        if self._stopped or self.started is not None:
            return
        loop = asyncio.get_running_loop()
        self.started = loop.time()
        self.limit_s = self._limit_s()
        if self.limit_s is not None:
            self._scope.reschedule(self.started + self.limit_s)

    def elapsed_s(self) -> float:
        assert self.started is not None
        return asyncio.get_running_loop().time() - self.started

    def stop(self) -> None:
        """The batch is over: its clock never starts now, and the next batch's does."""
        self._stopped = True
        if self.left is not None and not self.left.done():
            self.left.set_result(None)


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
    pipelines: Sequence[Replica], timeout_s: float, first_replica: int = 0
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
