"""The repository API and the start of the reconciler: which versions the server serves, kept in
step with the repository on disk.

At start it reads the repository (``serving.repository.source``), plans the private local Ray
for every version the policies select, takes a first step per model (every selected version
starts loading: LOADING, READY once warm, UNAVAILABLE with a one-line reason when its load
fails), and starts the reconciler's loop (``serving.repository.reconciler``), which polls the
repository every ``repository_poll_s`` and moves the versions from then on.

The repository API (``serving.protocols.contract.RepositoryControl``): ``index`` says what
each model and version is (``serving.repository.index``); ``load`` reads the model's directory
again, takes its step (a failed version loads again) and waits until the loads end, raising why
one failed; ``unload`` holds the model against polling and waits until every version of it is
retired (refused with the reason, what it admitted answered, its actors ended). Both set the desired
state and take the step at once, under the model's lock, as the loop's tick does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from serving.canary.controller import Rollouts
from serving.errors import InvalidInputError, NotFoundError, NotReadyError
from serving.repository.index import UNLOADED, index_entries
from serving.repository.reconciler import Reconciler
from serving.repository.registry import Registry
from serving.repository.replica_switch import Rolling
from serving.repository.source import Source, not_in_repository, selected_settings, source_for
from serving.settings.config import Settings
from serving.version.runner import RunnerFactory, plan_private_ray

if TYPE_CHECKING:
    from serving.protocols.contract import IndexEntry, RepositoryControl

__all__ = ["UNLOADED", "Repository"]

log = logging.getLogger("shardserve")


class Repository:
    def __init__(
        self,
        state: Registry,
        settings: Settings,
        runner_factory: RunnerFactory,
        on_load_failure: Callable[[str], None] | None = None,
        *,
        source: Source | None = None,
    ) -> None:
        self.state = state
        self.settings = settings
        # With --model, one model whose load failure ends the server; in a repository a broken
        # version is refused with its reason while the others serve.
        single = settings.model_repository is None
        self._source = source if source is not None else source_for(settings)
        self.reconciler = Reconciler(state, runner_factory, on_load_failure if single else None)
        self._loop: asyncio.Task[None] | None = None

    @property
    def rollouts(self) -> Rollouts:
        """The canaries' controllers (the admin routes' view of them)."""
        return self.reconciler.rollouts

    @property
    def rolling(self) -> Rolling:
        """The switches replica by replica under way."""
        return self.reconciler.rolling

    # ---- life

    async def start(self) -> None:
        """Read the repository and start loading what each model's policy selects; then the
        reconciler's loop (polling every ``repository_poll_s``; 0: never)."""
        plans = await asyncio.to_thread(self._source.scan)
        # Before the first load starts a private local Ray: its CPU count holds every version.
        plan_private_ray(selected_settings(plans))
        reconciler = self.reconciler
        for name in sorted(plans):
            reconciler.set_plan(name, plans[name])
            await reconciler.step(name)
        default = self.state.default_model
        if default is not None and default not in plans:
            log.warning(
                "the default model %r is not in the model repository (it holds %s); /predict "
                "answers 404 until it is",
                default,
                ", ".join(repr(n) for n in sorted(plans)) or "nothing",
            )
        self._loop = reconciler.run(self._poll, self.settings.repository_poll_s)

    async def stop(self, timeout_s: float) -> None:
        """End the loop and what it has in flight (the server's stop drains and closes what is
        served)."""
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.wait([self._loop], timeout=max(timeout_s, 0.01))
        await self.reconciler.stop(timeout_s)

    async def poll_once(self) -> None:
        """Bring every model in step with the repository as it is on disk now."""
        if await self._poll():
            await self.reconciler.tick()

    async def _poll(self) -> bool:
        """Read the repository into the desired state; False where it could not be read."""
        try:
            plans = await asyncio.to_thread(self._source.scan)
        except OSError as exc:  # the repository's mount gone for a moment: keep serving
            log.warning("could not read the model repository (%s); serving what is loaded", exc)
            return False
        reconciler = self.reconciler
        for name in sorted(set(plans) | set(reconciler.plans)):
            reconciler.set_plan(name, plans.get(name))
        return True

    # ---- the repository API

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        reconciler = self.reconciler
        return index_entries(
            self.state, reconciler.plans, reconciler.held, reconciler.rollouts.note, ready_only
        )

    async def load(self, name: str) -> None:
        plans = await asyncio.to_thread(self._source.scan)
        plan = plans.get(name)
        reconciler = self.reconciler
        if plan is None:
            raise NotFoundError(not_in_repository(name, plans))
        if plan.error is not None:
            reconciler.plans[name] = plan
            raise InvalidInputError(plan.error)
        if not plan.selected:
            reconciler.plans[name] = plan
            on_disk = sorted(plan.versions)
            raise InvalidInputError(
                f"model {name!r} has no version to load: its version policy ({plan.policy}) "
                f"selects none of the complete versions in the repository {on_disk}"
            )
        reconciler.held.discard(name)
        reconciler.set_plan(name, plan)
        await reconciler.step(name, retry=True)
        chosen = [self.state.models.get(name, {}).get(str(v)) for v in plan.selected]
        loading = [m for m in chosen if m is not None]
        await asyncio.gather(*(m.wait_load() for m in loading))
        failed = [m for m in loading if m.phase == "failed"]
        if failed:
            raise NotReadyError(
                "; ".join(
                    f"model {name!r} version {m.version} failed to load: {m.reason}" for m in failed
                )
            )

    async def unload(self, name: str) -> None:
        reconciler = self.reconciler
        if name not in reconciler.plans and name not in self.state.models:
            raise NotFoundError(not_in_repository(name, reconciler.plans))
        reconciler.held.add(name)
        await reconciler.step(name)
        await reconciler.until_retired(name)
        self.state.unserved[name] = UNLOADED
        log.info("model %r %s", name, UNLOADED)


if TYPE_CHECKING:

    def _what_the_routes_see(repository: Repository) -> RepositoryControl:
        # For mypy only: the manager is the repository API's control.
        return repository
