"""One replica of the model: K stage actors in one placement group, chained through ObjectRefs.

A batch enters stage 0 and the refs are chained actor to actor, so the driver never waits between
stages: while stage 1 computes batch n, stage 0 already computes batch n+1.
``shards.pipeline.placement`` places and starts a replica's actors;
``shards.pipeline.replica_set.ReplicaSet`` routes batches over replicas and
``shards.pipeline.recovery`` brings back one that fails. Each batch is timed by a
``shards.pipeline.watchdog.BatchClock``, from when stage 0 starts it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from shards.bundle.tensor_routes import Route, Source, request_readers
from shards.cluster import run_bounded
from shards.errors import ReplicaLostError, StageTimeoutError
from shards.pipeline.compiled import CompiledStages
from shards.pipeline.faults import is_replica_fault, translate
from shards.pipeline.health import ReplicaState
from shards.pipeline.watchdog import ON_READY, BatchClock, Watchdog, set_when_ready
from shards.split import GUEST_GROUP, DriverCombine, combine_outputs
from shards.tracing import BATCH

log = logging.getLogger(__name__)

# Killing actors and removing a placement group take milliseconds on a live cluster; past this a
# shutdown stops waiting for a GCS that is gone.
CLOSE_TIMEOUT_S = 10.0
# How long each stage actor is given to say it is alive when a batch ran past the watchdog's limit.
LIVENESS_TIMEOUT_S = 1.0


class Replica:
    """One replica: K stage actors chained through ObjectRefs, and its health."""

    def __init__(
        self,
        actors: Sequence[Any],
        routes: tuple[Route, ...],
        output_sources: dict[str, Source],
        group: PlacementGroup,
        combines: tuple[DriverCombine, ...] = (),
        hosts: Sequence[int] = (),
    ) -> None:
        # By stage: a guest stage (``hosts``: run by another stage's actor, a tied table held
        # once) has its host's actor here, called in the guests' concurrency group.
        self.actors = list(actors)
        self.hosts = tuple(hosts)
        self.placement_group = group
        self.inflight = 0
        self.state = ReplicaState.HEALTHY
        self._closed = False
        # Batches in flight by arrival; the oldest one when a fault hit is its suspect.
        self._seq = itertools.count()
        self._running: set[int] = set()
        self._fault_seq: int | None = None
        # Each running batch's watchdog scope, and why they were all ended early (``abandon``).
        self._scopes: dict[int, asyncio.Timeout] = {}
        self._lost: str | None = None
        # Set by the last batch handed to stage 0 once it has left stage 0.
        self._first_stage_tail: asyncio.Future[None] | None = None
        self._routes = routes
        self._output_sources = output_sources
        self._combines = combines
        self._request_readers = request_readers(routes)
        # Only the model outputs that a stage makes are awaited (a split output's parts in its
        # place); the rest of a stage's outputs go from stage to stage and never come back here.
        self._awaited = {
            n: s for n, s in output_sources.items() if not s.from_request and not s.by_driver
        }
        self.compiled: CompiledStages | None = None

    def compile(self, max_inflight: int) -> None:
        """Switch this replica to a compiled graph over its actors (inside the event loop)."""
        self.compiled = CompiledStages(
            self.actors, self._routes, self._awaited, max_inflight, self.hosts
        )

    def call(self, stage: int, method: str, **options: Any) -> tuple[Any, dict[str, Any]]:
        """Stage ``stage``'s actor ``method`` with ``options`` (and for a guest stage its
        concurrency group), and the keywords that name the stage to its actor (a guest's)."""
        method_of = getattr(self.actors[stage], method)
        if not self.guest(stage):
            return (method_of.options(**options) if options else method_of), {}
        return method_of.options(concurrency_group=GUEST_GROUP, **options), {"stage": stage}

    def guest(self, stage: int) -> bool:
        """Whether stage ``stage`` runs in another stage's actor (``shards.split.hosts``)."""
        return bool(self.hosts) and self.hosts[stage] != stage

    @property
    def processes(self) -> list[Any]:
        """Each actor once (a host's handle stands for its guests too)."""
        return list({id(a): a for a in self.actors}.values())

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
        clock: BatchClock | None = None
        try:
            async with asyncio.timeout(None) as scope:
                self._scopes[seq] = scope
                clock = BatchClock(scope, lambda: watchdog.limit_s(rows) if watchdog else None)
                outputs = await self._run(inputs, clock)
            if watchdog is not None and clock.started is not None:
                watchdog.observe(rows, clock.elapsed_s())
            return outputs
        except Exception as exc:
            timed_out = isinstance(exc, TimeoutError) and not isinstance(
                exc, ray.exceptions.RayError
            )
            limit = clock.limit_s if clock is not None else None
            if timed_out and self._lost is not None:
                exc = ReplicaLostError(f"{self._lost} (its compiled graph closed with it)")
            elif timed_out and limit is not None:
                past = f"the batch ran past the watchdog's limit of {limit:.3g} s"
                dead = await self.dead_stage()
                exc = (
                    ReplicaLostError(f"a stage process failed: {dead} ({past})")
                    if dead is not None
                    else StageTimeoutError(past)
                )
            error = translate(exc)
            if is_replica_fault(error):
                if self._fault_seq is None:
                    self._fault_seq = min(self._running)
                error.victim = seq != self._fault_seq
            raise error from None
        finally:
            if clock is not None:
                clock.stop()
            self._scopes.pop(seq, None)
            self._running.discard(seq)
            self.inflight -= 1

    async def dead_stage(self) -> str | None:
        """Why a stage actor is dead or restarting (its error's type), asked of each for at most
        ``LIVENESS_TIMEOUT_S`` when a batch ran past the watchdog's limit; None when none is.

        A batch lost to a dead stage is retried, a hung one is not: a restart that takes longer
        than the limit (a large stage reloading) must not be called a hang. An actor that does
        not answer in time is alive and busy (it runs one task at a time): that batch hung."""

        async def ask(actor: Any) -> str | None:
            try:
                async with asyncio.timeout(LIVENESS_TIMEOUT_S):
                    await actor.info.remote()
            except ray.exceptions.RayActorError as exc:
                return type(exc).__name__
            except Exception:
                return None  # no answer in time (busy), or nothing that says it died
            return None

        found = await asyncio.gather(*(ask(actor) for actor in self.processes))
        return next((why for why in found if why is not None), None)

    def abandon(self, why: str) -> None:
        """End every batch in flight now, as lost with ``why``: a compiled graph is closed by a
        stage actor's death, and Ray 2.60 leaves its batches waiting (until the watchdog)."""
        self._lost = why
        now = asyncio.get_running_loop().time()
        for scope in self._scopes.values():
            scope.reschedule(now)

    def clear_fault(self) -> None:
        """Back in the rotation: the next fault has a suspect of its own."""
        self._fault_seq = None
        self._lost = None

    def _enter_first_stage(self, clock: BatchClock) -> asyncio.Future[None]:
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

    async def _run(self, inputs: dict[str, np.ndarray], clock: BatchClock) -> dict[str, np.ndarray]:
        if self.compiled is not None:
            outputs = await self.compiled.run(inputs, lambda: self._enter_first_stage(clock))
            return await self._joined(inputs, outputs)
        # A request tensor that several stages read goes into the object store once.
        request = {
            name: ray.put(inputs[name]) if readers > 1 else inputs[name]
            for name, readers in self._request_readers.items()
        }
        # Top-level refs as arguments: Ray hands each stage the arrays themselves, fetched from
        # the stage that made them.
        made: list[list[Any]] = []
        # A traced batch's context goes with each stage call (``shards.tracing``).
        traced = BATCH.get()
        trace = {} if traced is None else {"trace": traced.traceparent}
        for stage, route in enumerate(self._routes):
            args = [
                request[s.name] if s.from_request else made[s.stage][s.index] for s in route.inputs
            ]
            forward, named = self.call(stage, "forward", num_returns=route.num_returns)
            out = forward.remote(*args, **trace, **named)
            made.append([out] if route.num_returns == 1 else list(out))
        # No await since stage 0 was called: batches enter in the order of their stage-0 calls.
        left = self._enter_first_stage(clock)
        if ON_READY:
            set_when_ready(made[0][0], left)
        refs = [made[s.stage][s.index] for s in self._awaited.values()]
        values = await asyncio.gather(*refs)
        return await self._joined(inputs, dict(zip(self._awaited, values, strict=True)))

    async def _joined(
        self, inputs: dict[str, np.ndarray], made: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if not self._combines:
            return self._outputs(inputs, made)
        # A join of a large output takes seconds (GPT-2's logits: 6.6 GB at 32 x 1024): off
        # the event loop (shards.split).
        return await asyncio.to_thread(self._outputs, inputs, made)

    def _outputs(
        self, inputs: dict[str, np.ndarray], made: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        # A split output is joined here, from its parts (numpy; shards.split).
        if self._combines:
            made = {**made, **combine_outputs(self._combines, made)}
        parts = {p for c in self._combines for p in c.parts}
        return {
            name: inputs[name] if src.from_request else made[name]
            for name, src in self._output_sources.items()
            if name not in parts
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
            await asyncio.gather(*(answer(a) for a in self.processes))

    def kill_actors(self) -> None:
        """Stop every stage at once, running task included, and let Ray restart them.

        ``ray.cancel`` does not interrupt a running task of a regular actor; a kill does.
        """
        for actor in self.processes:
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
        for actor in {id(a): a for a in actors}.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                log.warning("killing shard actor %s failed", actor, exc_info=True)
        remove_placement_group(group)

    return run_bounded(run, timeout_s, f"closing a pipeline of {len(actors)} shard actors")
