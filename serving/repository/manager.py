"""The repository manager: which versions the server serves, kept in step with the repository.

At start it reads the repository (``serving.repository.source``) and starts, per model,
the versions its policy selects: each a ``ServedModel`` loading in the background (LOADING, READY
once warm, UNAVAILABLE with a one-line reason when its load fails). Then, on the repository API
(``load``, ``unload``) and every ``repository_poll_s``, it compares the repository with what it
serves, per model: what is newly selected loads; what is no longer selected, or gone from disk,
is unloaded; a version that serves, only once what replaces it is READY (load before retire:
the new version loads and warms up while the old one serves, its queue deeper meanwhile:
``serving.repository.switch_queue``; one that fails leaves the old one serving). An unload refuses
new requests (503 saying why), answers what the version holds, ends its actors and only then
stops routing to it. An unload through the API holds: polling leaves it until an API load.

A failed version keeps its reason in the index and its actors end at once; polling retries it
only once its files change (their fingerprint), a load through the API always. Labels from
``config.toml`` point only at READY versions; one that cannot is left unset and logged
(``serving.repository.labels``). With ``[traffic]`` in its ``config.toml`` a new READY version is a
canary beside the stable one instead (``serving.canary.controller``), the old stable retired once
it is promoted. Where the cluster cannot hold the new version's replicas beside the old one's,
the switch goes replica by replica (``serving.repository.replica_switch``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from serving.canary.controller import Rollouts
from serving.errors import InvalidInputError, NotFoundError, NotReadyError
from serving.repository.index import UNLOADED, index_entries
from serving.repository.labels import Labels
from serving.repository.replica_switch import Rolling
from serving.repository.source import (
    REMOVED,
    ModelPlan,
    Source,
    not_in_repository,
    selected_settings,
    source_for,
    why_retired,
)
from serving.repository.switch_queue import narrow_queues, widen_queues
from serving.settings.config import Settings
from serving.supervisor import supervise
from serving.version.life import VersionState
from serving.version.readiness import version_state
from serving.version.runner import RunnerFactory, plan_private_ray
from serving.version.served import ServedModel

if TYPE_CHECKING:
    from serving.http.model import IndexEntry, RepositoryControl
    from serving.server.state import ServerState

__all__ = ["UNLOADED", "Repository"]

log = logging.getLogger("shardserve")

_THROUGH_API = "through the repository API"
_RETRIED = "to load it again: its files changed since its load failed"
# Ending a failed version's actors: milliseconds on a live cluster; a Ray that is gone is not
# waited for longer than this.
_CLOSE_FAILED_S = 10.0


class Repository:
    def __init__(
        self,
        state: ServerState,
        settings: Settings,
        runner_factory: RunnerFactory,
        on_load_failure: Callable[[str], None] | None = None,
        *,
        source: Source | None = None,
    ) -> None:
        self.state = state
        self.settings = settings
        self._factory = runner_factory
        # With --model, one model whose load failure ends the server; in a repository a broken
        # version is refused with its reason while the others serve.
        single = settings.model_repository is None
        self._on_load_failure = on_load_failure if single else None
        self._source = source if source is not None else source_for(settings)
        self._plans: dict[str, ModelPlan] = {}
        self._held: set[str] = set()  # unloaded through the API: polling leaves them be
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # (name, version) -> the fingerprint its files had when its load failed
        self._failed: dict[tuple[str, str], str] = {}
        self._labels = Labels(state)
        self.rollouts = Rollouts(state, self._roles_changed)
        self.rolling = Rolling(state, self._locked_hand_over)
        self._tasks: set[asyncio.Task[None]] = set()
        state.repository = self

    # ---- life

    async def start(self) -> None:
        """Read the repository and start loading what each model's policy selects; then poll
        every ``repository_poll_s`` (0: never)."""
        plans = await asyncio.to_thread(self._source.scan)
        # Before the first load starts a private local Ray: its CPU count holds every version.
        plan_private_ray(selected_settings(plans))
        for name in sorted(plans):
            await self._reconcile(name, plans[name], retry=False)
        default = self.state.default_model
        if default is not None and default not in plans:
            log.warning(
                "the default model %r is not in the model repository (it holds %s); /predict "
                "answers 404 until it is",
                default,
                ", ".join(repr(n) for n in sorted(plans)) or "nothing",
            )
        if self.settings.repository_poll_s > 0:
            self._spawn("repository_poll", self._poll_forever, "the model repository's poll")
        self._spawn("rollout_watch", self.rollouts.watch, "the canaries' judge")

    async def stop(self, timeout_s: float) -> None:
        """End the polling and the watch on loads (the server's stop drains and closes what is
        served)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=max(timeout_s, 0.01))

    async def poll_once(self) -> None:
        """Bring every model in step with the repository as it is on disk now."""
        try:
            plans = await asyncio.to_thread(self._source.scan)
        except OSError as exc:  # the repository's mount gone for a moment: keep serving
            log.warning("could not read the model repository (%s); serving what is loaded", exc)
            return
        for name in sorted(set(plans) | set(self._plans) | set(self.state.models)):
            await self._reconcile(name, plans.get(name), retry=False)

    # ---- the repository API

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        entries = index_entries(self.state, self._plans, self._held, self.rollouts.note)
        return [e for e in entries if e["state"] == "READY"] if ready_only else entries

    async def load(self, name: str) -> None:
        plans = await asyncio.to_thread(self._source.scan)
        plan = plans.get(name)
        if plan is None:
            raise NotFoundError(not_in_repository(name, plans))
        if plan.error is not None:
            self._plans[name] = plan
            raise InvalidInputError(plan.error)
        if not plan.selected:
            self._plans[name] = plan
            on_disk = sorted(plan.versions)
            raise InvalidInputError(
                f"model {name!r} has no version to load: its version policy ({plan.policy}) "
                f"selects none of the complete versions in the repository {on_disk}"
            )
        self._held.discard(name)
        await self._reconcile(name, plan, retry=True)
        chosen = [self.state.models.get(name, {}).get(str(v)) for v in plan.selected]
        loading = [m for m in chosen if m is not None]
        await asyncio.gather(*(m.wait_load() for m in loading))
        failed = [m for m in loading if m.state is VersionState.FAILED]
        if failed:
            raise NotReadyError(
                "; ".join(
                    f"model {name!r} version {m.version} failed to load: {m.reason}" for m in failed
                )
            )

    async def unload(self, name: str) -> None:
        if name not in self._plans and name not in self.state.models:
            raise NotFoundError(not_in_repository(name, self._plans))
        self._held.add(name)
        async with self._locks[name]:
            await self._retire(list(self.state.models.get(name, {}).values()), _THROUGH_API)
            self.state.unserved[name] = UNLOADED
        log.info("model %r %s", name, UNLOADED)

    # ---- in step with a plan

    async def _reconcile(self, name: str, plan: ModelPlan | None, *, retry: bool) -> None:
        async with self._locks[name]:
            served = dict(self.state.models.get(name, {}))
            if plan is None:
                self._plans.pop(name, None)
                await self._retire(list(served.values()), REMOVED)
                return
            before = self._plans.get(name)
            if plan.error is not None and (before is None or before.error != plan.error):
                log.error("model %r: %s; serving what is loaded of it", name, plan.error)
            self._plans[name] = plan
            if name in self._held or plan.error is not None:
                return
            wanted = set(plan.selected)
            again = [
                m
                for v, m in served.items()
                if int(v) in wanted
                and m.state is VersionState.FAILED
                and (retry or self._changed(m, plan))
            ]
            for v in sorted(wanted - {int(v) for v in served}):
                self._load(name, v, plan)
            # A failed version serves nothing: it goes at once, and loads again.
            await self._retire(again, _THROUGH_API if retry else _RETRIED)
            for model in again:
                self._load(name, int(model.version), plan)
            await self._hand_over(name)

    async def _hand_over(self, name: str) -> None:
        """Retire the versions the plan no longer holds or selects (the model's lock held).

        One that serves stays while a selected version still loads or none is READY (a new one
        that failed keeps the old); its turn comes when a selected version's load ends
        (``_settle``). Requests that name no version reach the highest READY version."""
        plan = self._plans.get(name)
        if plan is None or plan.error is not None or name in self._held:
            return
        keep = self.rollouts.arrange(name, plan) | self.rolling.keep(name)  # canary, switch
        served = self.state.models.get(name, {})
        wanted = [version_state(served[str(v)])[0] for v in plan.selected if str(v) in served]
        settled = not plan.selected or ("LOADING" not in wanted and "READY" in wanted)
        retiring = [
            m
            for v, m in served.items()
            if int(v) not in plan.selected
            and v not in keep
            and (settled or version_state(m)[0] != "READY")
        ]
        for model in retiring:  # at once: the next request that names no version goes on
            _refuse(model, why_retired(plan, model.version))
        await asyncio.gather(*(self._retire_one(m, why_retired(plan, m.version)) for m in retiring))
        self._set_labels(name)

    def _changed(self, model: ServedModel, plan: ModelPlan) -> bool:
        key = (model.name, model.version)
        return self._failed.get(key) != plan.versions[int(model.version)].fingerprint

    def _load(self, name: str, version: int, plan: ModelPlan) -> None:
        found = plan.versions[version]
        assert found.settings is not None  # selected versions have their settings
        model = ServedModel(name, found.settings, self.state.metrics, version=str(version))
        self.state.add_model(model)
        widen_queues(self.state.models[name].values(), model)  # while it loads
        self.rollouts.listen(model)
        model.start(self.rolling.factory(model, plan, self._factory), self._on_load_failure)
        log.info("model %r version %d: loading", name, version)
        what = f"model {name!r} version {version}'s settle (the end of its load)"
        self._spawn("settle", lambda: self._settle(model, found.fingerprint), what, restart=False)

    async def _settle(self, model: ServedModel, fingerprint: str) -> None:
        """Once its load ends: a failed version's actors end (its reason stays in the index);
        then what it was to replace is retired, or kept if it failed. Whatever fails here, the
        queues widened for its load narrow, and a hand-over that did not happen is tried again
        until it does (the failure goes to ``supervise``, which logs and counts it)."""
        try:
            await self.rolling.settle(model)  # a switch replica by replica ends first
            key = (model.name, model.version)
            if model.state is VersionState.FAILED:
                self._failed[key] = fingerprint
                await model.stop_jobs(_CLOSE_FAILED_S)
                await model.close(_CLOSE_FAILED_S)
            else:
                self._failed.pop(key, None)
            await self._locked_hand_over(model.name)
        except Exception:
            # The hand-over reads what is served now: running it again is safe.
            self._spawn_hand_over(model.name)
            raise
        finally:
            narrow_queues(model.name, self.state.models.get(model.name, {}).values())

    def _roles_changed(self, name: str) -> None:
        """A promote retires the old stable; every change of role moves the labels."""
        self._set_labels(name)
        self._spawn_hand_over(name)

    def _spawn_hand_over(self, name: str) -> None:
        what = f"model {name!r}'s hand-over (retiring what it no longer serves)"
        self._spawn("hand_over", lambda: self._locked_hand_over(name), what)

    async def _locked_hand_over(self, name: str) -> None:
        async with self._locks[name]:
            await self._hand_over(name)

    async def _retire(self, models: list[ServedModel], reason: str) -> None:
        await asyncio.gather(*(self._retire_one(m, reason) for m in models))

    async def _retire_one(self, model: ServedModel, reason: str) -> None:
        """Refuse new requests, answer those admitted (``ServedModel.retire``), end the actors,
        then stop routing to it."""
        await model.retire(_refusal(model, reason))
        self.state.remove_model(model.name, model.version)
        self.rollouts.gone(model.name, model.version)
        self._failed.pop((model.name, model.version), None)
        self.state.metrics.remove_model(model.name, model.version)
        log.info("model %r version %s unloaded: %s", model.name, model.version, reason)
        self._set_labels(model.name)

    def _set_labels(self, name: str) -> None:
        self._labels.set(name, self._plans.get(name), self.rollouts.roles(name))

    async def _poll_forever(self) -> None:
        # A poll that raises ends this loop; ``supervise`` logs it and starts it again.
        while True:
            await asyncio.sleep(self.settings.repository_poll_s)
            await self.poll_once()

    def _spawn(
        self,
        task: str,
        job: Callable[[], Coroutine[Any, Any, None]],
        what: str,
        *,
        restart: bool = True,
    ) -> None:
        """Start ``job`` under ``supervise`` (``task``: its counter label); ``stop`` ends it."""
        started = supervise(task, job, self.state.metrics, what=what, restart=restart)
        self._tasks.add(started)
        started.add_done_callback(self._tasks.discard)


def _refuse(model: ServedModel, reason: str) -> None:
    model.stop_accepting(_refusal(model, reason))


def _refusal(model: ServedModel, reason: str) -> str:
    return f"model {model.name!r} version {model.version} is being unloaded ({reason})"


if TYPE_CHECKING:

    def _what_the_routes_see(repository: Repository) -> RepositoryControl:
        # For mypy only: the manager is the repository API's control.
        return repository
