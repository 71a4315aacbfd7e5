"""The one loop that moves versions: it compares what should be served with what runs and takes
the next step, per model, once a tick (every ``TICK_S``, and at once on ``poke``).

What should be served (the desired state): each model's plan, read from the repository on disk
(``serving.repository.source``: its complete versions, the ones its ``config.toml``'s policy
selects, its labels and ``[traffic]``), read again every ``repository_poll_s``; the models
unloaded through the repository API (``held``: polling leaves them be until an API load); a
canary's roles and weights with the judge's verdict, recorded by the canary's controller
(``serving.canary.controller``); and, for a switch replica by replica, the new version's
replica target (``serving.repository.replica_switch``).

The steps, per model: a selected version that is not served loads (a ``ServedModel`` started;
the other versions' queues widen meanwhile, ``serving.repository.switch_queue``); a failed one
loads again once its files change (an API load: always). Once a load ends, where the new version
replaces an old one replica by replica, one step of that switch per tick
(``serving.repository.replica_switch``: a replica added or given up); then its settle: a failed
version's actors end, and the hand-over. The hand-over retires what the plan no longer selects,
or what is gone from disk, but a version that serves only once what replaces it is READY (one
that failed keeps the old), and leaves a canary's stable and canary and a switch's old version
be; the labels follow the READY versions and the canary's roles; a canary promoted has its old
stable retired. A model unloaded through the API, or gone from disk, has every version retired.
Every retire is one drain (``ServedModel.retire``: refuse with the reason, answer what was
admitted, end the actors), then the version leaves the registry
(``serving.repository.registry``).

Long operations (a load and its settle, a switch step, a retire) are started by a step and run as
tasks tracked per (model, version, kind), at most one of each in flight; the next tick sees
their end. A step or operation that raises is counted
(``shardserve_background_errors_total{task}``) and taken again: a retire that failed is started
again, a hand-over done again; nothing is left undone in a task nobody awaits. One that keeps
failing is taken again after a pause that doubles up to a minute, and logged as
``serving.supervisor.RepeatedFailures`` says: its traceback once, then a line with the count at
most every minute, not a traceback a second per model.

The scale step, per READY version, at most every ``SCALE_PERIOD_S``: the version is observed
(``serving.elastic.steps.observe``: the batcher sampled, the pure policy asked for its desired
count), its batching limits applied (``serving.elastic.limits.apply_limits``: the operator's,
the replicas that serve, a switch's widening, combined) and its next step taken, one replica
added or removed (``serving.elastic.steps.scale_step``, run as a task of its own: an add may wait
minutes for a node while the ticks go on; the elastic part keeps its own limits on what runs at
once). A version that retires, and every version at the stop, has its steps under way cancelled.
The canary step judges a model's canary, promotes or rolls it back and moves its labels, on each
tick and at once when a canary's answers make its judge due. The stop step (``refuse_all``): once
the server stops, every version refuses new requests.

It is one idea over 500 lines: the desired state against what runs, and each step the loop takes
toward it; the steps' own rules live in the modules they call (the switch, the elastic steps, the
canary's controller).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass
from functools import partial
from typing import Any

from serving.batching.dispatch import SHUTTING_DOWN
from serving.canary.controller import Rollouts
from serving.canary.split import CanarySplit
from serving.elastic.count import inherited_settings
from serving.elastic.limits import apply_limits
from serving.elastic.steps import observe, run_step, scale_step, stop_scaling
from serving.repository.index import UNLOADED
from serving.repository.labels import Labels
from serving.repository.registry import Registry
from serving.repository.replica_switch import Rolling
from serving.repository.source import REMOVED, ModelPlan, why_retired
from serving.repository.switch_queue import (
    backlog_within_own,
    narrow_queues,
    widen_queue,
    widen_queues,
)
from serving.supervisor import RepeatedFailures, start_supervised
from serving.version.runner import RunnerFactory
from serving.version.served import ServedModel

__all__ = ["RETRIED", "THROUGH_API", "TICK_S", "Reconciler", "refuse_all"]

log = logging.getLogger("shardserve")

TICK_S = 1.0
# How often a READY version is sampled for its replica count: the autoscaler's delays (seconds to
# a minute) are counted in these.
SCALE_PERIOD_S = 1.0
THROUGH_API = "through the repository API"
RETRIED = "to load it again: its files changed since its load failed"
# Ending a failed version's actors: milliseconds on a live cluster; a Ray that is gone is not
# waited for longer than this.
_CLOSE_FAILED_S = 10.0
# The loop itself failing (a bug in a tick's own code): started again after this pause,
# doubling up to the second figure, as ``serving.supervisor`` does for every loop.
_RESTART_S = (1.0, 60.0)

Op = tuple[str, str, str]  # (model name, version, kind)


@dataclass(eq=False)
class _Load:
    """A version whose load was started and has not settled yet."""

    model: ServedModel
    fingerprint: str  # its files' when its load began: a failed one loads again once they change
    narrowed: bool = False  # its widening of the other versions' queues has been undone


class Reconciler:
    def __init__(
        self,
        state: Registry,
        runner_factory: RunnerFactory,
        on_load_failure: Callable[[str], None] | None,
    ) -> None:
        self.state = state
        self._factory = runner_factory
        self._on_load_failure = on_load_failure
        self.plans: dict[str, ModelPlan] = {}  # the desired state: each model's plan on disk
        self.held: set[str] = set()  # unloaded through the API: polling leaves them be
        # (name, version) -> the fingerprint its files had when its load failed
        self._failed: dict[tuple[str, str], str] = {}
        self._loads: dict[ServedModel, _Load] = {}
        self._ops: dict[Op, asyncio.Task[None]] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._labels = Labels(state)
        self.rollouts = Rollouts(
            state.models, state.metrics, self._roles_changed, self._canary_step
        )
        self.rolling = Rolling(state, self.hand_over_now, self._drain)
        self._wake = asyncio.Event()
        self._observed: dict[ServedModel, float] = {}  # a version's last scale sample
        self._failures = RepeatedFailures()

    # ---- the loop

    def poke(self, name: str | None = None) -> None:
        """Take the next steps now rather than at the next tick (``name``: the model whose
        desired state changed; every model is looked at)."""
        self._wake.set()

    def run(
        self, poll: Callable[[], Coroutine[Any, Any, object]], poll_s: float
    ) -> asyncio.Task[None]:
        """The loop as a task: a tick every ``TICK_S`` or on ``poke``, ``poll()`` (reading the
        repository again) every ``poll_s`` (0: never)."""
        next_poll = time.monotonic() + poll_s

        async def loop() -> None:
            nonlocal next_poll
            while True:
                wait = TICK_S if poll_s <= 0 else min(TICK_S, next_poll - time.monotonic())
                # asyncio.timeout, not wait_for: a wait_for whose event is set as the loop is
                # cancelled swallows the cancel (Python 3.11), and the stop waits for the loop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(wait, 0.0)):
                        await self._wake.wait()
                self._wake.clear()
                if poll_s > 0 and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + poll_s
                    await self._guarded("repository_poll", "the model repository's poll", poll)
                await self.tick()

        return start_supervised(
            "reconciler",
            loop,
            what="the reconciler's loop",
            on_error=self.state.metrics.background_error,
            pause=_RESTART_S,
        )

    async def tick(self) -> None:
        """Judge the canaries, take each model's next step, then each READY version's scale
        step."""
        if not self.state.accepting:
            refuse_all(self.state)
        self.rollouts.check()
        for name in sorted(set(self.plans) | set(self.state.models)):
            key = ("reconcile", name)
            if self._failures.wait_s(key) > 0:
                continue  # it failed: taken again after its pause
            what = f"model {name!r}'s reconcile step"
            await self._guarded("reconcile", what, partial(self.step, name), key=key)
        self.scale(time.monotonic())

    def scale(self, now: float) -> None:
        """Each READY version sampled at most every ``SCALE_PERIOD_S`` and its next replica
        step started; a sample that raises is logged and counted (``task="scaling"``), and the
        next tick samples again."""
        for versions in list(self.state.models.values()):
            for model in list(versions.values()):
                if not model.takes_requests:
                    continue
                last = self._observed.get(model)
                if last is not None and now - last < SCALE_PERIOD_S:
                    continue
                key = ("scaling", model.name, model.version)
                if self._failures.wait_s(key) > 0:
                    continue
                self._observed[model] = now
                what = f"model {model.name!r} version {model.version}'s scale step"
                try:
                    observe(model, now)
                    apply_limits(model)  # the replicas that serve now: a source of its limits
                    step = scale_step(model)
                except Exception as exc:
                    self.state.metrics.background_error("scaling")
                    self._failures.failed(key, what, exc)
                    continue
                self._failures.succeeded(key, what)
                if step is not None:
                    run_step(model, step)

    async def stop(self, timeout_s: float) -> None:
        """End what is in flight (the server's stop drains and closes what is served)."""
        for versions in self.state.models.values():
            for model in versions.values():
                stop_scaling(model)
        tasks = list(self._ops.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=max(timeout_s, 0.01))

    # ---- the desired state

    def set_plan(self, name: str, plan: ModelPlan | None) -> None:
        """The model's plan as read from disk now (``None``: gone from the repository)."""
        if plan is None:
            self.plans.pop(name, None)
            return
        before = self.plans.get(name)
        if plan.error is not None and (before is None or before.error != plan.error):
            log.error("model %r: %s; serving what is loaded of it", name, plan.error)
        self.plans[name] = plan

    async def until_retired(self, name: str) -> None:
        """Until every version of ``name`` being retired has gone (an unload's wait); raises
        what a retire raised."""
        retiring = [t for (n, _, kind), t in self._ops.items() if n == name and kind == "retire"]
        await asyncio.gather(*retiring)

    # ---- one model's step

    async def step(self, name: str, *, retry: bool = False) -> None:
        """Bring model ``name`` one step closer to its desired state; ``retry``: a failed
        version loads again whether or not its files changed (a load through the API)."""
        async with self._locks[name]:
            plan = self.plans.get(name)
            held = name in self.held
            if plan is None or held:
                for model in list(self.state.models.get(name, {}).values()):
                    self._start_retire(model, THROUGH_API if held else REMOVED)
                if held and name not in self.state.models:
                    self.state.unserved[name] = UNLOADED
                return
            if plan.error is not None:
                return
            served = dict(self.state.models.get(name, {}))
            wanted = set(plan.selected)
            again = [
                m
                for v, m in served.items()
                if int(v) in wanted
                and m.phase == "failed"
                and (retry or (m not in self._loads and self._changed(m, plan)))
            ]
            for v in sorted(wanted - {int(v) for v in served}):
                self._load(name, v, plan)
            # A failed version serves nothing: it goes at once, and loads again.
            await asyncio.gather(
                *(self._retire(m, THROUGH_API if retry else RETRIED) for m in again)
            )
            for model in again:
                self._load(name, int(model.version), plan)
            pending = [
                load
                for load in self._loads.values()
                if load.model.name == name and (name, load.model.version, "retire") not in self._ops
            ]
            for load in pending:
                self._settle_step(load)
            if not pending:
                self._hand_over(name)

    def _changed(self, model: ServedModel, plan: ModelPlan) -> bool:
        key = (model.name, model.version)
        return self._failed.get(key) != plan.versions[int(model.version)].fingerprint

    def _load(self, name: str, version: int, plan: ModelPlan) -> None:
        found = plan.versions[version]
        assert found.settings is not None  # selected versions have their settings
        # A version switch keeps the capacity: it starts at the count its model serves with.
        settings = inherited_settings(found.settings, self.state.models.get(name, {}).values())
        model = ServedModel(name, settings, self.state.metrics, version=str(version))
        self.state.add_model(model)
        if not self.state.accepting:  # the server stops: it refuses from the start
            model.stop_accepting(SHUTTING_DOWN)
        widen_queues(self.state.models[name].values(), model)  # while it loads
        # and its own from its first request until what it replaces has drained (its settle)
        model.before_ready = widen_queue
        self._loads[model] = _Load(model, found.fingerprint)
        self.rollouts.listen(model)
        model.start(self.rolling.factory(model, plan, self._factory), self._on_load_failure)
        log.info("model %r version %d: loading", name, version)
        self._start_settle(self._loads[model])

    def _settle_step(self, load: _Load) -> None:
        """A version whose load was started: once it has ended, the next step of its switch
        replica by replica, if one is under way, else its settle (again, if one raised)."""
        model = load.model
        key = (model.name, model.version)
        if (*key, "settle") in self._ops or (*key, "switch") in self._ops:
            return  # its load, a switch step or its settle under way
        switch_step = self.rolling.step(model)
        if switch_step is not None:
            what = f"model {model.name!r} version {model.version}'s switch step"
            self._start((*key, "switch"), what, switch_step)
        else:
            self._start_settle(load)

    def _start_settle(self, load: _Load) -> None:
        model = load.model
        what = f"model {model.name!r} version {model.version}'s settle (the end of its load)"
        self._start((model.name, model.version, "settle"), what, lambda: self._settle(load))

    async def _settle(self, load: _Load) -> None:
        """Once its load has ended (waited for here), and a switch replica by replica it began
        has ended (its steps come first: ``_settle_step``): a failed version's actors end (its
        reason stays in the index), then what it was to replace is retired, or kept if it
        failed. Whatever fails here, the queues widened for its load narrow, once what it
        retired has gone (``switch_queue``); a settle that raises is taken again on the next
        tick."""
        model = load.model
        await model.wait_load()
        if self.rolling.under_way(model):
            return  # the switch's steps, then the settle again
        try:
            key = (model.name, model.version)
            if model.phase == "failed":
                self._failed[key] = load.fingerprint
                await model.stop_jobs(_CLOSE_FAILED_S)
                await model.close(_CLOSE_FAILED_S)
            else:
                self._failed.pop(key, None)
            async with self._locks[model.name]:
                retiring = self._hand_over(model.name)
            self._loads.pop(model, None)
            if retiring:
                await asyncio.wait(retiring)
            await backlog_within_own(self.state.models.get(model.name, {}).values())
        finally:
            self._narrow(load)

    def _narrow(self, load: _Load) -> None:
        """``load`` has ended: once no load of its model is under way, the queues widened for
        them narrow."""
        if load.narrowed:
            return
        load.narrowed = True
        name = load.model.name
        if not any(o.model.name == name and not o.narrowed for o in self._loads.values()):
            narrow_queues(self.state.models.get(name, {}).values())

    # ---- the hand-over

    async def hand_over_now(self, name: str) -> None:
        """The hand-over, waited for: until what it retires has gone."""
        async with self._locks[name]:
            started = self._hand_over(name)
        await asyncio.gather(*started)

    def _hand_over(self, name: str) -> list[asyncio.Task[None]]:
        """Retire the versions the plan no longer holds or selects (the model's lock held).

        One that serves stays while a selected version still loads or none is READY (a new one
        that failed keeps the old); its turn comes when a selected version's load ends (its
        settle). Requests that name no version reach the highest READY version."""
        plan = self.plans.get(name)
        if plan is None or plan.error is not None or name in self.held:
            return []
        keep = self.rollouts.arrange(name, plan.traffic, plan.selected) | self.rolling.keep(name)
        self._publish(name)
        served = self.state.models.get(name, {})
        wanted = [served[str(v)] for v in plan.selected if str(v) in served]
        loading = any(m.phase == "loading" for m in wanted)
        settled = not plan.selected or (not loading and any(m.available for m in wanted))
        # One that is not READY (loading, failed, draining) serves nothing: it goes at once. A
        # READY one whose replicas are down for a while is READY still: taken on every tick,
        # this rule must not retire the version that serves over a replica's restart.
        retiring = [
            m
            for v, m in served.items()
            if int(v) not in plan.selected and v not in keep and (settled or not m.takes_requests)
        ]
        for model in retiring:  # at once: the next request that names no version goes on
            model.stop_accepting(_refusal(model, why_retired(plan, model.version)))
        started = [self._start_retire(m, why_retired(plan, m.version)) for m in retiring]
        self._set_labels(name)
        return started

    def _canary_step(self, name: str) -> None:
        """A canary's answers made its judge due: the reconciler's canary step (judge; promote
        or roll back; the labels follow, ``_roles_changed``), taken at once, so that a canary
        that fails is rolled back on the answer that tipped it (not one request later)."""
        self.rollouts.check_one(name)

    def _roles_changed(self, name: str) -> None:
        """A canary's verdict or an admin's move: the labels follow at once; the next tick
        retires an old stable."""
        self._set_labels(name)
        self.poke(name)

    def _set_labels(self, name: str) -> None:
        self._labels.set(name, self.plans.get(name), self.rollouts.roles(name))

    def _publish(self, name: str) -> None:
        """The model's canary split, where it has one, is the registry's traffic for it."""
        split = self.rollouts.split(name)
        if split is not None:
            self.state.traffic[name] = split
        elif isinstance(self.state.traffic.get(name), CanarySplit):
            del self.state.traffic[name]

    # ---- the one drain

    def _start_retire(self, model: ServedModel, reason: str) -> asyncio.Task[None]:
        what = f"model {model.name!r} version {model.version}'s retire ({reason})"
        key = (model.name, model.version, "retire")
        return self._start(key, what, lambda: self._retire(model, reason))

    async def _retire(self, model: ServedModel, reason: str) -> None:
        """Refuse new requests, answer those admitted (``ServedModel.retire``), end the actors,
        then stop routing to it."""
        stop_scaling(model)
        self._observed.pop(model, None)
        await model.retire(_refusal(model, reason))
        load = self._loads.pop(model, None)
        if load is not None:  # retired before its load settled
            self._narrow(load)
        self.rolling.drop(model)
        if self.state.models.get(model.name, {}).get(model.version) is model:
            self.state.remove_model(model.name, model.version)
        self.rollouts.gone(model.name, model.version)
        self._publish(model.name)
        self._failed.pop((model.name, model.version), None)
        self.state.metrics.remove_model(model.name, model.version)
        log.info("model %r version %s unloaded: %s", model.name, model.version, reason)
        self._set_labels(model.name)

    async def _drain(self, model: ServedModel, reason: str) -> None:
        """A switch's drain of a version that stays in the index: DRAINING until the switch
        says how it ended (``ServedModel.end_retire``)."""
        await model.retire(reason, keep_draining=True)

    # ---- operations in flight

    def _start(
        self, key: Op, what: str, job: Callable[[], Coroutine[Any, Any, None]]
    ) -> asyncio.Task[None]:
        """Run ``job`` as the one operation ``key`` in flight (the one running, if there is);
        its failure is logged and counted, and raised to whoever awaits it."""
        running = self._ops.get(key)
        if running is not None:
            return running
        pause = self._failures.wait_s(key)  # it failed before: in flight, after its pause

        async def run() -> None:
            if pause > 0:
                await asyncio.sleep(pause)
            await self._guarded(key[2], what, job, reraise=True, key=key)

        task = asyncio.create_task(run())
        task.set_name(f"shardserve-{key[2]}")
        self._ops[key] = task

        def ended(done: asyncio.Task[None]) -> None:
            if self._ops.get(key) is done:
                del self._ops[key]
            if done.cancelled():
                return
            if done.exception() is None:  # (retrieved: one that raised is logged already)
                self.poke(key[0])  # what follows it, now; a failure waits for the next tick

        task.add_done_callback(ended)
        return task

    async def _guarded(
        self,
        kind: str,
        what: str,
        job: Callable[[], Coroutine[Any, Any, object]],
        *,
        reraise: bool = False,
        key: Hashable | None = None,
    ) -> None:
        key = (kind, what) if key is None else key
        try:
            await job()
        except Exception as exc:
            self.state.metrics.background_error(kind)
            self._failures.failed(key, what, exc)
            if reraise:
                raise
        else:
            self._failures.succeeded(key, what)


def refuse_all(state: Registry) -> None:
    """The server stops: every version it serves refuses new requests from now on (503,
    shutting down) and answers what it holds; the server's stop (``ServerState.begin_stop``)
    takes this step at once, and each tick takes it again while the server stops."""
    for model in state.served():
        model.stop_accepting(SHUTTING_DOWN)


def _refusal(model: ServedModel, reason: str) -> str:
    return f"model {model.name!r} version {model.version} is being unloaded ({reason})"
