"""A version switch replica by replica, where the cluster cannot hold both versions (issue 21).

The reconciler's switch (``serving.repository.reconciler``) loads the new version beside the old
one and retires the old once the new one is READY. Where the new version's N replicas do not fit
beside the old one's (``fits``: N of the old's per-replica placement groups against what the
cluster has free, ``shards.capacity``), the new version starts with one replica instead (where
not even one fits, the old first gives one up: never fewer than N-1 serve). Once it is READY,
requests that name no version are split between the two by their healthy replicas (a
``serving.repository.routing.SwitchSplit`` in the registry's traffic); then step by step the old
gives up a replica (drained) and the new adds one, until the old's last replica is retired
through the reconciler's hand-over (nothing dropped) and the new has N. A step that fails (the
replica not placed within ``replica_pending_timeout_s``, or it failed to start) turns the switch
back the same way: the old adds back what it gave up, the new is drained and closed (the
reconciler's one drain, ``ServedModel.retire``), and the index shows why in one line. Both
versions' scaling loops are held meanwhile. With one replica, or with a ``[traffic]`` canary,
the switch is the one-step hand-over.

The switch is a record (``Switch``: the two versions, the counts at start and end, its phase)
and steps: once the new version's load has ended, the reconciler takes one step per tick (one
replica added or given up, ``Rolling.step``) as an operation tracked per version, at most one in
flight, and the new version settles (the hand-over) once the switch has ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from serving.elastic.count import add_replica, remove_replica, serving_count
from serving.elastic.limits import apply_limits, follow_replicas
from serving.elastic.steps import hold, release
from serving.repository.routing import SwitchSplit
from serving.settings.config import Settings
from serving.version.runner import ElasticRunner, ModelRunner, RunnerFactory

if TYPE_CHECKING:
    from serving.generation.engine import Generator
    from serving.repository.registry import Registry
    from serving.repository.source import ModelPlan
    from serving.version.served import ServedModel

__all__ = ["Drain", "Fits", "Rolling", "ray_fits"]

log = logging.getLogger("shardserve")

# Whether ``count`` more replicas like the version's fit in what the cluster has free now.
Fits = Callable[["ServedModel", int], Awaitable[bool]]
# The reconciler's one drain: refuse with the reason, answer what it admitted, end its actors;
# the version stays DRAINING (in the index) until ``end_retire``.
Drain = Callable[["ServedModel", str], Awaitable[None]]
Phase = Literal["start", "forward", "back", "done"]
# How often a replica being added is asked what it waits for (the reason a failed step gives).
_LOOK_S = 1.0


async def ray_fits(model: ServedModel, count: int) -> bool:
    """``count`` more replicas of ``model`` fit in the Ray cluster's free resources; True when
    its runner does not say what a replica asks (a fake: nothing to judge)."""
    bundles = getattr(model.runner, "replica_bundles", None)
    if not bundles:
        return True
    from shards.capacity import replicas_fit

    strategy = model.settings.placement_strategy
    why = await asyncio.to_thread(replicas_fit, bundles, count, strategy)
    if why is not None:
        log.info("model %r: %s", model.name, why)
    return why is None


@dataclass(eq=False)
class Switch:
    """One model's switch: ``start`` replicas of the old version at its start, ``target`` of
    the new at its end; ``phase``: ``start`` (the new one loads), ``forward`` (the new adds, the
    old gives up), ``back`` (turned back: the old adds back, the new gives up; ``why``: the step
    that failed, None where the new one failed to load), ``done``; ``gone``: the old's last
    replica has been retired; ``room``: a replica was given up for the next add, which is then
    not asked whether it fits again; ``stuck``: turning back, a replica could not be added."""

    old: ServedModel
    new: ServedModel
    target: int
    start: int
    phase: Phase = "start"
    why: str | None = None
    gone: bool = False
    room: bool = False
    stuck: bool = False


class Rolling:
    """Which new version replaces its old one replica by replica, the steps, and the versions
    the reconciler keeps meanwhile. ``fits`` may be replaced (tests)."""

    def __init__(
        self, state: Registry, hand_over: Callable[[str], Awaitable[None]], drain: Drain
    ) -> None:
        self.state = state
        self.fits: Fits = ray_fits
        self._hand_over = hand_over  # retires what the reconciler no longer keeps (drained)
        self._drain_version = drain
        self._switches: dict[str, Switch] = {}

    def factory(self, model: ServedModel, plan: ModelPlan, factory: RunnerFactory) -> RunnerFactory:
        """``model``'s runner factory: where it replaces a READY version that the cluster cannot
        hold beside it, it starts with one replica and the switch goes replica by replica."""
        old = self._replaced(model, plan)
        if old is None:
            return factory

        async def build(settings: Settings) -> ModelRunner | Generator:
            return await factory(await self._begin(old, model, settings))

        return build

    def keep(self, name: str) -> set[str]:
        """The old version of a switch under way: the manager leaves it serving."""
        switch = self._switches.get(name)
        return set() if switch is None or switch.gone else {switch.old.version}

    def switching(self, name: str) -> bool:
        """A switch of model ``name`` has not ended (its last step not taken yet)."""
        return name in self._switches

    def under_way(self, model: ServedModel) -> bool:
        """``model`` is the new version of a switch that has not ended: its steps come before
        its settle."""
        switch = self._switches.get(model.name)
        return switch is not None and switch.new is model

    def step(self, model: ServedModel) -> Callable[[], Coroutine[Any, Any, None]] | None:
        """The next step of the switch whose new version is ``model`` (once its load has ended):
        one replica added or given up, or the switch's end; None where it has none."""
        switch = self._switches.get(model.name)
        if switch is None or switch.new is not model:
            return None
        return lambda: self._step(switch)

    def drop(self, model: ServedModel) -> None:
        """``model`` is retired: a switch it was the new version of, or the old one of before
        its last replica went (an unload, a removal), ends."""
        switch = self._switches.get(model.name)
        if switch is not None and (
            switch.new is model or (switch.old is model and not switch.gone)
        ):
            self._end(switch)

    async def _step(self, switch: Switch) -> None:
        try:
            if switch.phase == "start":
                if switch.new.takes_requests:
                    switch.phase = "forward"
                    self.state.traffic[switch.new.name] = SwitchSplit(
                        switch.old.version, switch.new.version
                    )
                elif switch.old.takes_requests:  # the new one failed to load
                    switch.phase = "back"
                else:
                    switch.phase = "done"
            elif switch.phase == "forward":
                await self._forward(switch)
            elif switch.phase == "back":
                await self._back(switch)
        except Exception:  # the reconciler's hand-over goes on: the READY version serves
            log.exception("model %r: the switch replica by replica failed", switch.new.name)
            switch.phase = "done"
        if switch.phase == "done":
            self._end(switch)

    def _end(self, switch: Switch) -> None:
        switch.phase = "done"
        if self._switches.get(switch.new.name) is switch:
            del self._switches[switch.new.name]
            self._unsplit(switch.new.name)
        release(switch.old)
        release(switch.new)

    # ---- the steps

    def _replaced(self, model: ServedModel, plan: ModelPlan) -> ServedModel | None:
        if plan.traffic is not None or model.name in self._switches:
            return None
        served = self.state.models.get(model.name, {})
        leaving = [
            m
            for v, m in served.items()
            if m is not model and int(v) not in plan.selected and m.takes_requests
        ]
        if not leaving:
            return None
        old = max(leaving, key=lambda m: int(m.version))
        return old if isinstance(old.runner, ElasticRunner) else None

    async def _begin(self, old: ServedModel, new: ServedModel, settings: Settings) -> Settings:
        target, start = settings.replicas, serving_count(old.health()) or 1
        if target < 2 or not old.takes_requests or await self._fits(old, target):
            return settings
        switch = self._switches[new.name] = Switch(old, new, target, start)
        why = f"version {new.version} replaces version {old.version} replica by replica"
        hold(old, why)
        hold(new, why)
        log.info(
            "model %r: %d replica(s) of version %s do not fit beside version %s's %d; it starts "
            "with one and replaces version %s replica by replica",
            new.name,
            target,
            new.version,
            old.version,
            start,
            old.version,
        )
        if start > 1 and not await self._fits(old, 1):
            await self._remove(switch, old)
        return settings.model_copy(update={"replicas": 1})

    async def _forward(self, switch: Switch) -> None:
        """One step forward: make room for the new version's next replica (the old gives one
        up, or its last one is retired), or add it; a replica not added turns the switch back
        (or, once the old is gone, leaves the new with what it has)."""
        old, new = switch.old, switch.new
        if _count(new) >= switch.target:
            log.info(
                "model %r: version %s has its %d replicas", new.name, new.version, switch.target
            )
            switch.phase = "done"
            return
        if not (new.takes_requests and (switch.gone or old.takes_requests)):
            switch.phase = "done"  # unloaded or stopping meanwhile: the reconciler retires both
            return
        if not switch.room and not await self._fits(new, 1):
            if _count(old) > 1:
                await self._remove(switch, old)
            else:
                await self._retire_old(switch)
            switch.room = True  # the next step adds
            return
        switch.room = False
        added, waited = await self._add(switch, new)
        if added:
            return
        if not (new.takes_requests and (switch.gone or old.takes_requests)):
            switch.phase = "done"  # given up because it was unloaded meanwhile
            return
        step = f"its replica {_count(new) + 1} of {switch.target} was not placed within "
        step += f"replica_pending_timeout_s={new.settings.replica_pending_timeout_s:g} s or "
        step += f"failed to start ({waited or 'the log says why'})"
        if switch.gone:
            log.warning(
                "model %r version %s serves with %d of its %d replicas: %s",
                new.name,
                new.version,
                _count(new),
                switch.target,
                step,
            )
            switch.phase = "done"
            return
        switch.phase = "back"
        switch.why = f"replacing version {old.version} replica by replica: {step}"
        log.warning("model %r version %s: %s", new.name, new.version, switch.why)

    async def _back(self, switch: Switch) -> None:
        """One step back: the old adds back a replica it gave up (the new giving one up first
        where there is no room, its last one drained with the version); at the end the new is
        drained, and ``why`` (a step failed) becomes its reason in the index."""
        old, new, why = switch.old, switch.new, switch.why
        if _count(old) < switch.start and old.takes_requests and not switch.stuck:
            if not switch.room and not await self._fits(old, 1) and new.takes_requests:
                if _count(new) > 1:
                    await self._remove(switch, new)
                else:
                    await self._drain(new, why or "its switch was turned back")
                switch.room = True  # the next step adds
                return
            switch.room = False
            added, waited = await self._add(switch, old)
            if not added:
                log.warning(
                    "model %r version %s serves with %d of its %d replicas: one could not be "
                    "added back (%s)",
                    old.name,
                    old.version,
                    _count(old),
                    switch.start,
                    waited or "the log says why",
                )
                switch.stuck = True
            return
        if new.takes_requests:
            await self._drain(new, why or "its switch was turned back")
        if new.phase == "stopping":  # drained above: it ends as the switch did
            failure = None if why is None else f"{why}; version {old.version} serves with "
            new.end_retire(None if failure is None else f"{failure}{_count(old)} replica(s)")
        switch.phase = "done"

    async def _retire_old(self, switch: Switch) -> None:
        """The old's last replica: the reconciler retires the version (drained, nothing
        dropped)."""
        switch.gone = True
        self._unsplit(switch.new.name)
        await self._hand_over(switch.new.name)

    async def _drain(self, model: ServedModel, why: str) -> None:
        """Refuse, answer what it admitted, end its actors (the reconciler's one drain); it
        stays DRAINING until the switch says how it ended (``end_retire``)."""
        self._unsplit(model.name)
        await self._drain_version(
            model, f"model {model.name!r} version {model.version} is unloaded ({why})"
        )

    def _unsplit(self, name: str) -> None:
        if isinstance(self.state.traffic.get(name), SwitchSplit):
            del self.state.traffic[name]

    async def _add(self, switch: Switch, model: ServedModel) -> tuple[bool, str]:
        """One more replica of ``model``; whether it serves, and what it waited for."""
        runner = model.runner
        assert isinstance(runner, ElasticRunner)
        # Not a background task (no supervisor): this switch step awaits it and handles its
        # raise below; a task only so that the step can look at what the replica waits for.
        task = asyncio.ensure_future(add_replica(model, runner))
        waited = ""
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=_LOOK_S)
                waited = runner.health().pending_reason or waited
            added = task.result()
        except asyncio.CancelledError:
            task.cancel()
            raise
        except Exception as exc:
            log.warning("model %r version %s: adding a replica failed", model.name, model.version)
            added, waited = False, f"{type(exc).__name__}: {exc}".splitlines()[0]
        _follow(model)
        return added, waited

    async def _remove(self, switch: Switch, model: ServedModel) -> None:
        runner = model.runner
        assert isinstance(runner, ElasticRunner)
        await remove_replica(model, runner)
        _follow(model)

    async def _fits(self, model: ServedModel, count: int) -> bool:
        try:
            return await self.fits(model, count)
        except Exception:  # no answer: try to place (a replica with no room is given up)
            log.warning("could not tell whether %d replica(s) fit", count, exc_info=True)
            return True


def _follow(model: ServedModel) -> None:
    """A fixed-count version's batching limits follow its healthy replicas, as an elastic one's
    scaling loop keeps them (held, it still does)."""
    low, high = model.settings.replica_bounds()
    runner = model.runner
    if low != high or model.batcher is None or not isinstance(runner, ElasticRunner):
        return
    follow_replicas(model, runner.health().healthy)
    apply_limits(model)


def _count(model: ServedModel) -> int:
    return serving_count(model.health()) or 0
