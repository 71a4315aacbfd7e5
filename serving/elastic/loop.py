"""One served version's replica count following its load: the loop that reads the batcher, asks
the policy (``serving.elastic.policy.Autoscaler``) and adds or removes a replica through the
runner (``serving.version.runner.ElasticRunner``), and the batching limits that follow the
healthy replicas.

``run_scaling`` is one of a ``ServedModel``'s jobs: it starts once the version is READY and
ends with its jobs (``ServedModel.stop_jobs``). A version with a fixed count, or whose runner
cannot change its count (the tests' fakes), is never scaled; its ``ScaleStatus`` says so.
Adds and removes run as tasks of their own (``serving.server.supervise``: one that raises is
logged and counted, an add then given up as one that found no room), so that the loop keeps
sampling while a replica waits minutes for a node; at most one of each runs at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from serving.elastic.policy import Autoscaler, ScaleDecision, ScalePolicy, replica_rows
from serving.repository.switch_queue import queue_factor
from serving.server.supervise import supervise
from serving.settings.config import Settings, default_queue_rows
from serving.version.runner import ElasticRunner

if TYPE_CHECKING:
    from serving.batching.batcher import Batcher
    from serving.version.served import ServedModel
    from shards.pipeline.health import Health

__all__ = [
    "SCALE_PERIOD_S",
    "ScaleStatus",
    "Scaler",
    "hold",
    "inherit_count",
    "release",
    "run_scaling",
    "start_count",
]

log = logging.getLogger("shardserve")
# How often the loop samples the batcher: the delays (seconds to a minute) are counted in these.
SCALE_PERIOD_S = 1.0
# After an add that was given up (no room, or the replica failed to start), the next waits at
# least this long, doubling up to the cap: a cluster with no room is not asked every second.
RETRY_S = (10.0, 300.0)
_NOT_SERVING = ("starting", "pending")
# Versions whose count another part moves for a while (a version switch replica by
# replica, ``serving.repository.replica_switch``), with why: their loops keep the limits in
# step, decide nothing.
_held: WeakKeyDictionary[ServedModel, str] = WeakKeyDictionary()


def hold(model: ServedModel, why: str) -> None:
    """``model``'s loop stops deciding (its batching limits still follow) until ``release``."""
    _held[model] = why


def release(model: ServedModel) -> None:
    _held.pop(model, None)


@dataclass
class ScaleStatus:
    """What the V2 metadata and the admin view show: the bounds, the count the version should
    have and why (the last decision's reason and figures)."""

    minimum: int
    maximum: int
    target: int
    reason: str
    detail: str = ""
    pending: str = ""  # what a replica the cluster has not placed yet waits for, if one

    def parameters(self) -> dict[str, Any]:
        return {
            "min_replicas": self.minimum,
            "max_replicas": self.maximum,
            "target_replicas": self.target,
            "reason": self.reason,
            "detail": self.detail,
            "pending": self.pending,
        }


def start_count(settings: Settings, serving: int | None) -> Settings:
    """A new version's settings: when an older version of the model serves ``serving``
    replicas, the new one starts at that count (within its own bounds) so a version switch
    keeps the capacity the load needed; else as they are."""
    low, high = settings.replica_bounds()
    if serving is None or low == high:
        return settings
    count = min(max(serving, low), high)
    return (
        settings if count == settings.replicas else settings.model_copy(update={"replicas": count})
    )


def serving_count(health: Health | None) -> int | None:
    """The replicas of a version that serve or will (any state but draining), if known."""
    if health is None:
        return None
    return sum(1 for state in health.states if state != "draining") or None


def inherit_count(model: ServedModel, others: Iterable[ServedModel]) -> None:
    """A version switch: a new version starts at the count of the highest READY version of the
    model serving now (``start_count``). Called as the version is added, before it loads."""
    ready = [m for m in others if m.ready.is_set() and m.refusing is None]
    if ready:
        newest = max(ready, key=lambda m: (len(m.version), m.version))
        model.settings = start_count(model.settings, serving_count(newest.health()))


async def run_scaling(model: ServedModel, period_s: float = SCALE_PERIOD_S) -> None:
    """``model``'s scaling loop, from READY until cancelled."""
    await model.ready.wait()
    runner, batcher = model.runner, model.batcher
    low, high = model.settings.replica_bounds()
    if low == high:  # a fixed count: nothing to show or do
        return
    elastic = isinstance(runner, ElasticRunner)
    model.scaling = ScaleStatus(low, high, model.settings.replicas, "start" if elastic else "fixed")
    if not elastic or batcher is None:
        model.scaling.detail = "its runner cannot add or remove replicas"
        return
    assert isinstance(runner, ElasticRunner)
    scaler = Scaler(model, runner, batcher)
    try:
        while True:
            scaler.tick(time.monotonic())
            await asyncio.sleep(period_s)
    finally:
        scaler.cancel()


class Scaler:
    """The decisions of one version and the add/remove tasks they start."""

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
        self.stages: int = getattr(runner, "num_stages", 1)
        self.adds: list[asyncio.Task[None]] = []  # oldest first
        self.removing: asyncio.Task[None] | None = None
        # The count the last scale-up asked for: its replicas are placed one after another
        # (never two pending placement at a time), one per tick.
        self._want = 0
        self._offered = Offered(max(settings.upscale_delay_s, DEMAND_WINDOW_S))
        model.metrics.add_listener(self._offered.answered)
        self._retry_at = 0.0
        self._now = 0.0  # the last tick's
        self._retry_s = RETRY_S[0]
        # The batcher's in-flight limit as this loop last set it: one that differs was changed
        # by the operator (an admin PUT), and is theirs from then on.
        self._inflight_set = batcher.settings.max_inflight_batches
        self._start_rows = batcher.settings.max_queue_rows

    def tick(self, now: float) -> ScaleDecision:
        self._now = now
        health = self.runner.health()
        states = health.states
        healthy = states.count("healthy")
        placing = states.count("pending")
        pending = sum(states.count(s) for s in _NOT_SERVING)
        unseen = max(0, len(self.adds) - pending)  # asked for, not in the states yet
        pending += unseen
        replicas = sum(1 for s in states if s != "draining") + unseen
        if self._want <= replicas:
            self._want = 0  # reached (or overtaken by a remove): nothing more to place
        self.follow_limits(healthy)
        why = _held.get(self.model)
        if why is not None:
            if self.model.scaling is not None:
                self.model.scaling.reason, self.model.scaling.detail = "held", why
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
        self.act(now, decision)
        if decision.direction == "" and self._want > replicas and placing + unseen == 0:
            # The next replica of a scale-up that asked for several, once the last one is
            # placed: it starts while that one still loads.
            self._start_add(now)
        status = self.model.scaling
        if status is not None:
            status.target = decision.target
            if decision.reason:
                status.reason, status.detail = decision.reason, decision.detail
            status.pending = health.pending_reason  # what a replica not placed yet waits for
        return decision

    def replica_rows(self) -> float | None:
        """What one replica delivers (rows in flight at full pace), from the run-time model."""
        view = self.batcher.run_time_view()
        size = self.batcher.settings.max_batch_size
        latency_ms = view.get("latency", {}).get(str(size))
        bottleneck_ms = view.get("bottleneck", {}).get(str(size))
        if latency_ms is None or bottleneck_ms is None:
            return None
        return replica_rows(size, latency_ms / 1000, bottleneck_ms / 1000)

    def act(self, now: float, decision: ScaleDecision) -> None:
        if decision.direction == "up":
            if self.adds or now < self._retry_at:
                return
            self._event(decision)
            self._want = decision.target
            self._start_add(now)
        elif decision.direction == "down":
            self._want = 0
            if self.adds:
                # The replica still being placed or warmed goes first: cancelling the add
                # removes what it placed, and no replica that serves is touched.
                self._event(decision)
                self.adds[-1].cancel()
                return
            if self.removing is not None:
                return
            self._event(decision)
            self.removing = supervise(
                "scale_down", self._remove, self.model.server_metrics,
                what=f"{self._where}'s scale-down", restart=False,
            )  # fmt: skip

    def _start_add(self, now: float) -> None:
        if now >= self._retry_at:
            # A raise is logged and counted once by the supervisor, and the add given up (the
            # next scale-up decides again, after the retry pause).
            add = supervise(
                "scale_up", self._add, self.model.server_metrics,
                what=f"{self._where}'s scale-up", restart=False,
                on_failure=lambda _: self._given_up(),
            )  # fmt: skip
            self.adds.append(add)

    @property
    def _where(self) -> str:
        return f"model {self.model.name!r} version {self.model.version}"

    def follow_limits(self, healthy: int) -> None:
        """The batcher's in-flight batches, queue rows and pipeline depth for ``healthy``
        replicas, as at start-up for that many, except those the operator set (a flag, or an
        admin PUT since); the queue never shrinks below its start-up rows (a request that size
        was served)."""
        n, policy, settings = max(1, healthy), self.batcher.settings, self.settings
        inflight = policy.max_inflight_batches
        if settings.max_inflight_batches is None and inflight == self._inflight_set:
            inflight = settings.inflight_batches(self.stages, n)
        wanted: dict[str, int] = {
            "pipeline_depth": self.stages * n,
            "max_inflight_batches": inflight,
        }
        if settings.max_queue_rows is None:
            rows = default_queue_rows(policy.max_batch_size, inflight)
            wanted["max_queue_rows"] = max(rows, self._start_rows) * queue_factor(self.model)
        changes = {k: v for k, v in wanted.items() if getattr(policy, k) != v}
        if changes:
            self.batcher.reconfigure(**changes)
            self._inflight_set = inflight

    def cancel(self) -> None:
        for task in (*self.adds, self.removing):
            if task is not None:
                task.cancel()

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

    async def _add(self) -> None:
        try:
            added = await self.runner.add_replica(self.settings.replica_pending_timeout_s)
        finally:
            task = asyncio.current_task()  # the supervisor's task, which ``adds`` holds
            self.adds = [t for t in self.adds if t is not task]
        if added:
            self._retry_s = RETRY_S[0]
            return
        # The runner logged why (what the replica waited for).
        self._given_up()

    def _given_up(self) -> None:
        self._want = 0  # a replica given up: the next scale-up decides again, later
        self._retry_at = self._now + self._retry_s
        self._retry_s = min(self._retry_s * 2, RETRY_S[1])

    async def _remove(self) -> None:
        try:
            await self.runner.remove_replica(self.settings.drain_timeout_s)
        finally:
            self.removing = None


# The shortest window the offered load is measured over (the upscale delay when longer).
DEMAND_WINDOW_S = 5.0
# Fewer answers than this in the window tell nothing about what the load needs.
DEMAND_MIN_ANSWERS = 20


class Offered:
    """What the offered load needs, from the version's answers (every protocol's, through its
    metrics' listener): the healthy replicas times the requests answered over those answered
    without a 503 (a full queue, no healthy replica), over the last ``window_s``."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._answers = self._refused = 0
        # (when, answers, refused so far); the first mark stands for the loop's start.
        self._marks: deque[tuple[float, int, int]] = deque([(float("-inf"), 0, 0)])

    def answered(self, status: int, seconds: float) -> None:
        self._answers += 1
        self._refused += status == 503

    def demand(self, now: float, healthy: int) -> float | None:
        self._marks.append((now, self._answers, self._refused))
        while len(self._marks) > 1 and now - self._marks[1][0] >= self.window_s:
            self._marks.popleft()
        _, answers, refused = self._marks[0]
        answers, refused = self._answers - answers, self._refused - refused
        served = answers - refused
        if answers < DEMAND_MIN_ANSWERS or served <= 0 or healthy < 1:
            return None
        return healthy * answers / served
