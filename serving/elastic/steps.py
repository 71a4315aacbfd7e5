"""One served version's replica count following its load: what the reconciler calls on each tick.

- ``observe(model, now)`` samples the version (its replicas' health, the batcher's queue wait and
  rows in flight, what one replica delivers, the offered load), asks the pure policy
  (``serving.elastic.policy.decide``) and keeps the decision, the desired count, on the version
  (``ServedModel``'s ``ScaleState``, ``serving.version.scale_state``), and the healthy replicas
  as a source of its batching limits (``serving.elastic.limits``, applied by the reconciler's
  step), held or not.
- ``scale_step(model)`` is the coroutine of the next step, adding or removing ONE replica through
  the runner (``serving.version.runner.ElasticRunner``), or ``None``: at most one step per
  observation, none while the version is held (``hold``/``release``: a version switch replica by
  replica moves the count meanwhile).

The rules of a step live here, so that whoever runs it keeps them: an add while another is placed
but still starting (a scale-up that asked for several: they are placed one after another, never
two pending placement at a time); one remove at a time; a scale-down while an add is under way
cancels that add instead (its ``finally`` removes what it placed: no replica that serves is
touched); an add given up (no room, a replica that failed to start, or a raise) pauses the next
for ``RETRY_S``, doubling. The caller runs each returned coroutine as a task of its own (the
coroutine's ``__name__``, ``scale_up`` or ``scale_down``, is its label), logs and counts one that
raises, lets one that a later step cancelled end quietly, and asks ``scale_step`` again on every
tick, whether or not an earlier step still runs: the reconciler
(``serving.repository.reconciler``) does, on its ticks.

A version with a fixed count, or whose runner cannot change its count (the tests' fakes), is never
scaled; its ``ScaleStatus`` says so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from serving.elastic.count import add_replica, remove_replica
from serving.elastic.demand import DEMAND_WINDOW_S, Offered
from serving.elastic.limits import apply_limits, follow_replicas
from serving.elastic.policy import Autoscaler, ScaleDecision, ScalePolicy, replica_rows
from serving.supervisor import supervise
from serving.version.runner import ElasticRunner
from serving.version.scale_state import ScaleState, ScaleStatus

if TYPE_CHECKING:
    from serving.batching.batcher import Batcher
    from serving.version.served import ServedModel

__all__ = [
    "RETRY_S",
    "Scaler",
    "hold",
    "observe",
    "release",
    "run_step",
    "scale_state",
    "scale_step",
    "scaler_of",
    "stop_scaling",
]

log = logging.getLogger("shardserve")
# After an add that was given up (no room, or the replica failed to start), the next waits at
# least this long, doubling up to the cap: a cluster with no room is not asked every second.
RETRY_S = (10.0, 300.0)
_NOT_SERVING = ("starting", "pending")
Step = Coroutine[Any, Any, None]


def observe(model: ServedModel, now: float) -> None:
    """Sample ``model`` at ``now`` (monotonic) and keep what its count should be; nothing before
    it is READY or for a count that never changes."""
    scaler = scaler_of(model)
    if scaler is not None:
        scaler.observe(now)


def scale_step(model: ServedModel) -> Step | None:
    """The next step of ``model``'s count (add or remove one replica) after its last observation,
    when it differs from what it should be and it is not held; ``None`` otherwise."""
    scaler = scaler_of(model)
    return scaler.step() if scaler is not None else None


def stop_scaling(model: ServedModel) -> None:
    """``model``'s steps under way cancelled (it retires, or the server stops)."""
    scaler = scale_state(model).scaler
    if isinstance(scaler, Scaler):
        scaler.cancel()


def hold(model: ServedModel, why: str) -> None:
    """``model``'s steps stop (its batching limits still follow) until ``release``."""
    scale_state(model).held = why


def release(model: ServedModel) -> None:
    scale_state(model).held = None


def scale_state(model: ServedModel) -> ScaleState:
    """``model``'s scaling state (a field of the version that this package fills)."""
    return model.scale_state


def scaler_of(model: ServedModel) -> Scaler | None:
    """``model``'s ``Scaler``, made at its first look once READY; ``None`` before, and for a
    count that never changes (its ``ScaleStatus`` then says why, where it has bounds)."""
    state = scale_state(model)
    if isinstance(state.scaler, Scaler):
        return state.scaler
    if state.fixed or not model.takes_requests:
        return None
    runner, batcher = model.runner, model.batcher
    low, high = model.settings.replica_bounds()
    state.fixed = low == high or not isinstance(runner, ElasticRunner) or batcher is None
    if low == high:  # a fixed count: nothing to show or do
        return None
    elastic = isinstance(runner, ElasticRunner)
    model.scaling = ScaleStatus(low, high, model.settings.replicas, "start" if elastic else "fixed")
    if not isinstance(runner, ElasticRunner) or batcher is None:
        model.scaling.detail = "its runner cannot add or remove replicas"
        return None
    scaler = state.scaler = Scaler(model, runner, batcher)
    return scaler


def run_step(model: ServedModel, step: Step) -> asyncio.Task[None]:
    """Run ``step`` as a task of its own under ``serving.supervisor.supervise``: one that raises is
    logged and counted (``shardserve_background_errors_total{task="scale_up"}``), not run again."""
    name: str = getattr(step, "__name__", "scale_step")
    where = f"model {model.name!r} version {model.version}'s {name.replace('_', '-')}"
    return supervise(name, lambda: step, model.server_metrics, what=where, restart=False)


@dataclass(eq=False)
class _Under:
    """A step handed out: its task once it runs; ``withdrawn`` before it ran."""

    task: asyncio.Task[Any] | None = None
    withdrawn: bool = False


class Scaler:
    """One version's samples, the decision they lead to, and the steps under way."""

    def __init__(self, model: ServedModel, runner: ElasticRunner, batcher: Batcher) -> None:
        settings = model.settings
        low, high = settings.replica_bounds()
        self.model, self.runner, self.batcher, self.settings = model, runner, batcher, settings
        self.autoscaler = Autoscaler(
            ScalePolicy(
                low,
                high,
                settings.target_queue_wait_ms,
                settings.upscale_delay_s,
                settings.downscale_delay_s,
            )
        )
        self.adds: list[_Under] = []  # oldest first
        self.removing: _Under | None = None
        # The count the last scale-up asked for: its replicas are placed one after another
        # (never two pending placement at a time), one per observation.
        self._want = 0
        self._offered = Offered(max(settings.upscale_delay_s, DEMAND_WINDOW_S))
        model.metrics.add_listener(self._offered.answered)
        self._retry_at = 0.0
        self._now = 0.0  # the last observation's
        self._retry_s = RETRY_S[0]
        self._decision: ScaleDecision | None = None  # the last observation's, until stepped on
        self._next_add = False  # the next replica of a scale-up that asked for several

    def tick(self, now: float) -> ScaleDecision:
        """One sample, its limits and its step, run as a task (``run_step``): the interim
        driver's tick (the reconciler's ``scale`` takes the same three)."""
        decision = self.observe(now)
        apply_limits(self.model)
        step = self.step()
        if step is not None:
            run_step(self.model, step)
        return decision

    def observe(self, now: float) -> ScaleDecision:
        self._now = now
        health = self.runner.health()
        states = health.states
        healthy = states.count("healthy")
        placing = states.count("pending")
        pending = sum(states.count(s) for s in _NOT_SERVING)
        unseen = max(0, len(self.adds) - pending)  # handed out, not in the states yet
        pending += unseen
        replicas = sum(1 for s in states if s != "draining") + unseen
        if self._want <= replicas:
            self._want = 0  # reached (or overtaken by a remove): nothing more to place
        follow_replicas(self.model, healthy)
        self._decision, self._next_add = None, False
        status = self.model.scaling
        why = scale_state(self.model).held
        if why is not None:
            if status is not None:
                status.reason, status.detail = "held", why
            return ScaleDecision(replicas, "", "held", why)
        waited_s, inflight_rows = self.batcher.load()
        # The batching policy's own wait is a choice, not a backlog.
        queue_wait_ms = max(0.0, waited_s * 1000 - self.batcher.effective_wait_ms)
        decision = self.autoscaler.observe(
            now,
            queue_wait_ms=queue_wait_ms,
            inflight_rows=inflight_rows,
            healthy=healthy,
            pending=pending,
            replicas=replicas,
            replica_rows=self.replica_rows(),
            demand=self._offered.demand(now, healthy),
        )
        self._decision = decision
        # Once the last one is placed, the next starts while that one still loads.
        self._next_add = self._want > replicas and placing + unseen == 0
        if status is not None:
            status.target = decision.target
            if decision.reason:
                status.reason, status.detail = decision.reason, decision.detail
            status.pending = health.pending_reason  # what a replica not placed yet waits for
        return decision

    def step(self) -> Step | None:
        """The step the last observation asks for, once: ``scale_up``/``scale_down``'s
        coroutine, or ``None`` (a scale-down that cancels an add under way is taken here)."""
        decision, self._decision = self._decision, None
        if decision is None or scale_state(self.model).held is not None:
            return None
        now = self._now
        if decision.direction == "up":
            if self.adds or now < self._retry_at:
                return None
            self._event(decision)
            self._want = decision.target
            return self._add(now)
        if decision.direction == "down":
            self._want = 0
            if self.adds:
                # The replica still being placed or warmed goes first: cancelling the add
                # removes what it placed, and no replica that serves is touched.
                self._event(decision)
                self._withdraw(self.adds[-1])
                return None
            if self.removing is not None:
                return None
            self._event(decision)
            self.removing = _Under()
            return self.scale_down(self.removing)
        return self._add(now) if self._next_add else None

    def replica_rows(self) -> float | None:
        """What one replica delivers (rows in flight at full pace), from the run-time model."""
        view = self.batcher.run_time_view()
        size = self.batcher.settings.max_batch_size
        latency_ms = view.get("latency", {}).get(str(size))
        bottleneck_ms = view.get("bottleneck", {}).get(str(size))
        if latency_ms is None or bottleneck_ms is None:
            return None
        return replica_rows(size, latency_ms / 1000, bottleneck_ms / 1000)

    def cancel(self) -> None:
        """Cancel the steps under way (the version's scaling ends)."""
        for under in (*self.adds, self.removing):
            if under is not None:
                self._withdraw(under)

    def _add(self, now: float) -> Step | None:
        if now < self._retry_at:
            return None
        under = _Under()
        self.adds.append(under)
        return self.scale_up(under)

    def _withdraw(self, under: _Under) -> None:
        if under.task is not None:
            under.task.cancel()  # its ``finally`` forgets it
            return
        under.withdrawn = True  # handed out, not run yet: it will not
        self._forget(under)

    def _forget(self, under: _Under) -> None:
        self.adds = [u for u in self.adds if u is not under]
        if self.removing is under:
            self.removing = None

    def _event(self, decision: ScaleDecision) -> None:
        self.model.metrics.scale_event(decision.direction, decision.reason)
        log.info(
            "model %r version %s: scaling %s to %d replica(s) (%s: %s)",
            self.model.name,
            self.model.version,
            decision.direction,
            decision.target,
            decision.reason,
            decision.detail,
        )

    async def scale_up(self, under: _Under) -> None:
        if under.withdrawn:
            return
        under.task = asyncio.current_task()
        try:
            added = await add_replica(self.model, self.runner)
        except Exception:
            self._given_up()  # as one that found no room; the caller logs and counts the raise
            raise
        finally:
            self._forget(under)
        if added:
            self._retry_s = RETRY_S[0]
            return
        # The runner logged why (what the replica waited for).
        self._given_up()

    async def scale_down(self, under: _Under) -> None:
        if under.withdrawn:
            return
        under.task = asyncio.current_task()
        try:
            await remove_replica(self.model, self.runner)
        finally:
            self._forget(under)

    def _given_up(self) -> None:
        self._want = 0  # a replica given up: the next scale-up decides again, later
        self._retry_at = self._now + self._retry_s
        self._retry_s = min(self._retry_s * 2, RETRY_S[1])
