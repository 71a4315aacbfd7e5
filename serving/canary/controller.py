"""Canaries: a model whose ``config.toml`` has ``[traffic]`` keeps its stable version serving
while a newer one takes a share of the requests that name no version, judged against it.

``Rollout`` is one model's controller, as data: which version is ``stable`` and which the
``canary`` and their weights (``serving.canary.split.CanarySplit``, which the registry's routing
pick reads), each version's window of answered requests (fed by the versions'
``ModelMetrics.observe_routed``), and the verdict of the judge (``serving.canary.judge``, a pure
function of the windows). An answer only records its outcome: once the judge is due (at most
every ``_JUDGE_EVERY_S``) ``on_due`` asks the reconciler (``serving.repository.reconciler``) for
its canary step, which judges and acts at once (the answer that tipped it is the canary's last),
as it does on each of its ticks. A rollback sets the canary's weight to 0 (it stays loaded), a
promote (auto or through the admin API) makes the canary stable; then ``on_change`` tells the
reconciler, which moves the labels and retires the old stable (drained: nothing dropped). A
window holds only the requests the split routed (none that named a version or a label) and counts
only failures the version caused (``serving.canary.blame``): a client can neither roll a canary
back nor fail the stable until a canary is promoted.

``Rollouts`` holds a ``Rollout`` per model with ``[traffic]``; the reconciler asks it to arrange
the roles as versions become READY (a new READY version while another serves becomes the canary,
instead of the hand-over; a newer one replaces a rolled-back canary), which versions to keep,
and what the index shows for a rolled-back canary.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Literal, Protocol

from serving.canary.judge import judge
from serving.canary.split import CanarySplit, RandomSplit
from serving.canary.window import OutcomeWindow
from serving.errors import ConflictError, NotFoundError
from serving.supervisor import RepeatedFailures
from serving.telemetry import active

if TYPE_CHECKING:
    from serving.canary.config import TrafficConfig
    from serving.metrics.series import Metrics, ModelMetrics

__all__ = ["Rollout", "RolloutState", "Rollouts"]

log = logging.getLogger("shardserve")

RolloutState = Literal["stable", "canary", "rolled_back"]
# After a canary's answer the judge runs once a 1/_JUDGE_SHARE of its window's answers is new,
# or _JUDGE_EVERY_S after its last run: a p99 costs a pass over the windows, so a busy window is
# judged every few answers, not every one (each under 64 answers in the window is judged).
_JUDGE_SHARE = 64
_JUDGE_EVERY_S = 0.05


class Rollout:
    """One model's stable version, its canary and how unversioned requests split between them."""

    def __init__(
        self,
        name: str,
        stable: str,
        traffic: TrafficConfig,
        metrics: Metrics,
        on_change: Callable[[str], None],
        *,
        on_due: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.name = name
        self._rng = rng  # the split's draws: the system's generator unless a test seeds one
        self.split = CanarySplit(stable)
        self.traffic = traffic
        self.state: RolloutState = "stable"
        self.reason: str | None = None  # why the canary was rolled back
        self.canary_since = 0.0
        self.windows: dict[str, OutcomeWindow] = {stable: self._window()}
        self._metrics = metrics
        self._on_change = on_change  # tells the reconciler: it retires and relabels
        self._on_due = on_due  # asks the reconciler for its canary step (``check``)
        self._clock = clock
        self._judged = 0.0
        self._unjudged = 0  # canary answers since the judge last ran

    def now(self) -> float:
        """The clock its windows are kept by."""
        return self._clock()

    @property
    def stable(self) -> str:
        return self.split.stable

    @property
    def canary(self) -> str | None:
        return self.split.canary

    @property
    def weights(self) -> tuple[int, int]:
        """(stable, canary): the canary's is 0 once rolled back, and with no canary."""
        return self.split.weights

    def pick(self) -> str:
        """The version the next unversioned request goes to."""
        return self.split.pick()

    def peek(self) -> str:
        """The version the next ``pick`` would most likely give, without taking a turn (the
        HTTP protocol's refusal from headers looks a model up before the app does)."""
        return self.split.peek()

    # ---- outcomes

    def record(self, version: str, failed: bool, seconds: float) -> None:
        """A request the split routed to ``version`` answered; ``failed``: the version failed
        it (``serving.canary.blame``). Once the judge is due, ``on_due``: the reconciler's
        step judges (``check``), not this callback."""
        window = self.windows.get(version)
        if window is None:
            return
        now = self._clock()
        window.add(now, failed, seconds)
        if version != self.canary:
            return
        self._unjudged += 1
        if (
            self._unjudged * _JUDGE_SHARE >= window.count(now)
            or now - self._judged >= _JUDGE_EVERY_S
        ):
            self._judged = now  # due once: the step resets the count
            self._on_due(self.name)

    def check(self, now: float | None = None) -> None:
        """Judge the canary against the stable: roll back or promote it, or hold."""
        if self.state != "canary" or self.canary is None:
            return
        now = self._clock() if now is None else now
        self._judged, self._unjudged = now, 0
        verdict = judge(
            self.windows[self.stable],
            self.windows[self.canary],
            self.traffic.canary_rules,
            now,
            self.canary_since,
        )
        if verdict.action == "rollback":
            self.rollback(verdict.reason, verdict.detail)
        elif verdict.action == "promote":
            log.info(
                "model %r version %s promoted to stable (auto): %s",
                self.name,
                self.canary,
                verdict.detail,
            )
            self.promote()

    # ---- roles

    def start_canary(self, version: str) -> None:
        """``version`` becomes the canary at the configured weights (a previous one leaves)."""
        self.split.canary = version
        self.state = "canary"
        self.reason = None
        self.canary_since = self._clock()
        # Both windows start together: a stable window of answers from before the canary would
        # compare the canary with another time (a client could fail nothing before it and half
        # after, and the canary alone would look worse).
        self.windows = {self.stable: self._window(), version: self._window()}
        self._set_split(self.traffic.stable, self.traffic.canary)
        log.info(
            "model %r version %s: canary beside stable version %s at weights %d/%d",
            self.name,
            version,
            self.stable,
            *self.weights,
        )

    def promote(self) -> None:
        """The canary becomes stable at 100; the reconciler retires the old stable."""
        if self.canary is None:
            raise ConflictError(
                f"model {self.name!r} has no canary to promote; its stable version is {self.stable}"
            )
        split = self.split
        old, split.stable, split.canary = split.stable, self.canary, None
        self.windows = {self.stable: self.windows.get(self.stable) or self._window()}
        self.state, self.reason = "stable", None
        split.weights, split.split = (100, 0), None
        log.info("model %r: version %s is stable; retiring version %s", self.name, self.stable, old)
        self._on_change(self.name)

    def rollback(self, reason: str, detail: str) -> None:
        """The canary takes no more unversioned requests, at once; it stays loaded."""
        if self.canary is None or self.state == "rolled_back":
            what = "no canary" if self.canary is None else "its canary rolled back already"
            raise ConflictError(f"model {self.name!r} has {what}; nothing to roll back")
        self.state = "rolled_back"
        self.reason = f"rolled back: {detail}"
        self.split.weights, self.split.split = (self.weights[0] or 100, 0), None
        log.warning(
            "model %r version %s rolled back (%s): %s", self.name, self.canary, reason, detail
        )
        self._metrics.for_model(self.name, self.canary).rollback(reason)
        tracer = active.tracer
        if tracer is not None:  # a span of its own: no request's trace owns a rollback
            tracer.rollback(self.name, self.canary, self.stable, reason, detail)
        self._on_change(self.name)

    def set_weights(self, stable: int, canary: int) -> None:
        """New weights for the canary and the stable; a rolled-back canary given a share is
        judged again from an empty window."""
        if self.canary is None:
            raise ConflictError(
                f"model {self.name!r} has no canary: weights split requests between a stable "
                "version and a canary; a newer version becomes the canary once READY"
            )
        if self.state == "rolled_back" and canary > 0:
            self.state, self.reason = "canary", None
            self.canary_since = self._clock()
            self.windows[self.canary].clear()
            self.windows[self.stable].clear()
        self._set_split(stable, canary)
        log.info("model %r: weights stable %d, canary %d", self.name, stable, canary)

    def drop_canary(self) -> None:
        """The canary is no longer served (unloaded, removed): the stable takes everything."""
        self.split.canary, self.state, self.reason = None, "stable", None
        self.windows = {self.stable: self.windows.get(self.stable) or self._window()}
        self.split.weights, self.split.split = (100, 0), None

    def _set_split(self, stable: int, canary: int) -> None:
        self.split.weights = (stable, canary)
        if canary > 0 and self.canary is not None and self.state == "canary":
            self.split.split = RandomSplit({self.stable: stable, self.canary: canary}, self._rng)
        else:
            self.split.split = None

    def _window(self) -> OutcomeWindow:
        return OutcomeWindow(self.traffic.canary_rules.window_s)

    def reconfigure(self, traffic: TrafficConfig) -> None:
        """A changed ``config.toml``: its rules judge from now on (the windows keep their
        outcomes while the window's length stays); the weights stay as they are."""
        if traffic == self.traffic:
            return
        window_changed = traffic.canary_rules.window_s != self.traffic.canary_rules.window_s
        self.traffic = traffic
        if window_changed:
            self.windows = {v: self._window() for v in self.windows}


class ServedVersion(Protocol):
    """A served version as the rollouts read it (``serving.version.served.ServedModel``; a
    Protocol, so that the canary imports nothing of a version's runner, Ray or TensorFlow)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def metrics(self) -> ModelMetrics: ...

    @property
    def takes_requests(self) -> bool: ...


class Rollouts:
    """A ``Rollout`` per model whose plan has ``traffic``, its roles kept in step with the
    versions served (``models``: the registry's versions by name, read only)."""

    def __init__(
        self,
        models: Mapping[str, Mapping[str, ServedVersion]],
        metrics: Metrics,
        on_change: Callable[[str], None],
        on_due: Callable[[str], None],
    ) -> None:
        self._models = models
        self._metrics = metrics
        self._on_change = on_change
        self._on_due = on_due
        self._rollouts: dict[str, Rollout] = {}
        self._failures = RepeatedFailures()

    def __getitem__(self, name: str) -> Rollout:
        return self._rollouts[name]

    def __contains__(self, name: object) -> bool:
        return name in self._rollouts

    def names(self) -> list[str]:
        """The models with a rollout."""
        return sorted(self._rollouts)

    def split(self, name: str) -> CanarySplit | None:
        """The model's split of unversioned requests, if it has a rollout."""
        rollout = self._rollouts.get(name)
        return None if rollout is None else rollout.split

    def listen(self, model: ServedVersion) -> None:
        """The answers the server chose it for reach the model's rollout, if it has one (now
        or later)."""
        rollouts, name, version = self._rollouts, model.name, model.version

        def answered(failed: bool, seconds: float) -> None:
            rollout = rollouts.get(name)
            if rollout is not None:
                rollout.record(version, failed, seconds)

        model.metrics.add_routed_listener(answered)

    def arrange(
        self, name: str, traffic: TrafficConfig | None, selected: Collection[int]
    ) -> set[str]:
        """Bring the roles in step with what serves (``traffic``: the model's ``[traffic]``, or
        None; ``selected``: the versions its policy selects); the versions the reconciler must
        keep."""
        rollouts = self._rollouts
        if traffic is None:
            rollouts.pop(name, None)
            return set()
        served = self._models.get(name, {})
        ready = sorted((v for v, m in served.items() if m.takes_requests), key=int)
        rollout = rollouts.get(name)
        if rollout is not None and rollout.stable not in served:
            # The stable is gone (removed from disk): the canary, if it serves, takes over.
            if rollout.canary is not None and rollout.canary in served:
                rollout.promote()
            else:
                rollout = None
        if rollout is None:
            if not ready:
                rollouts.pop(name, None)
                return set()
            chosen = [v for v in ready if int(v) in selected]
            stable = (chosen or ready)[-1]
            rollout = Rollout(
                name, stable, traffic, self._metrics, self._on_change, on_due=self._on_due
            )
            rollouts[name] = rollout
        rollout.reconfigure(traffic)
        if rollout.canary is not None and rollout.canary not in served:
            rollout.drop_canary()
        newest = [v for v in ready if int(v) in selected]
        candidate = newest[-1] if newest else None
        if candidate is not None and int(candidate) > int(rollout.canary or rollout.stable):
            rollout.start_canary(candidate)
        return {v for v in (rollout.stable, rollout.canary) if v is not None}

    def gone(self, name: str, version: str) -> None:
        """``version`` no longer serves (retired): a canary leaves its role; a stable leaves
        it to the canary, if there is one, else the model's rollout ends."""
        rollout = self._rollouts.get(name)
        if rollout is None:
            return
        if name not in self._models:  # nothing of it serves (an unload)
            del self._rollouts[name]
        elif version == rollout.canary:
            rollout.drop_canary()
        elif version == rollout.stable:
            if rollout.canary is None:
                del self._rollouts[name]
            else:
                rollout.promote()

    def note(self, name: str, version: str) -> str:
        """What the index adds for a rolled-back canary (its reason), else ``""``."""
        rollout = self._rollouts.get(name)
        if rollout is None or rollout.canary != version or rollout.reason is None:
            return ""
        return rollout.reason

    def roles(self, name: str) -> dict[str, str | None]:
        """The ``stable`` and ``canary`` labels of a model with a rollout (``None``: no canary;
        the label is unset, whatever its ``config.toml`` says)."""
        rollout = self._rollouts.get(name)
        if rollout is None:
            return {}
        return {"stable": rollout.stable, "canary": rollout.canary}

    def get(self, name: str) -> Rollout:
        """The model's rollout, or a 404 naming what has one."""
        rollout = self._rollouts.get(name)
        if rollout is not None:
            return rollout
        with_one = sorted(self._rollouts)
        others = f"models with one: {with_one}" if with_one else "no model has one"
        versions = self._models.get(name, {})
        if versions and not any(m.takes_requests for m in versions.values()):
            why = "no rollout yet: none of its versions is ready (a rollout begins with the first)"
            raise NotFoundError(f"model {name!r} has {why}; {others}")
        if versions:
            why = "no rollout: its config.toml has no [traffic] table"
            raise NotFoundError(f"model {name!r} has {why}; {others}")
        raise NotFoundError(f"model {name!r} is not served; {others}")

    def check(self) -> None:
        """Judge every canary (the reconciler's tick: auto promotion needs no request)."""
        for name in list(self._rollouts):
            self.check_one(name)

    def check_one(self, name: str) -> None:
        """Judge model ``name``'s canary, if it has one (the reconciler's canary step)."""
        rollout = self._rollouts.get(name)
        if rollout is None or self._failures.wait_s(name) > 0:
            return
        what = f"model {name!r}: judging its canary"
        try:
            rollout.check()
        except Exception as exc:  # one model's judge must not end the others'
            self._failures.failed(name, what, exc)
        else:
            self._failures.succeeded(name, what)
