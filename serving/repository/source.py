"""What a server's repository holds and what of it is to be served: a ``ModelPlan`` per model.

``--model-repository DIR`` reads the directory (``serving.repository``: its complete versions,
each model's ``config.toml``, its version policy, each version's own settings); ``--model PATH``
is a repository of one model, version 1, served with the server's settings. The manager
(``serving.repository.manager``) compares a fresh plan with what it serves, the same way for both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from serving.canary.config import TrafficConfig
from serving.quoting import quote
from serving.repository.layout import Incomplete, VersionDir, scan_all
from serving.repository.model_config import model_settings, read_model_config
from serving.settings.config import ConfigError, Settings

__all__ = [
    "REMOVED",
    "Directory",
    "ModelPlan",
    "OneModel",
    "Source",
    "VersionPlan",
    "not_in_repository",
    "selected_settings",
    "source_for",
    "why_retired",
]

log = logging.getLogger("shardserve")

REMOVED = "removed from the model repository"


@dataclass(frozen=True)
class VersionPlan:
    version: int
    settings: Settings | None  # None when it cannot be served: ``error`` says why
    fingerprint: str = ""  # its files' sizes and mtimes: a failed version is retried on change
    error: str | None = None


@dataclass(frozen=True)
class ModelPlan:
    name: str
    # every complete version on disk, and those that stay incomplete (with why: ``Directory``)
    versions: dict[int, VersionPlan]
    selected: tuple[int, ...] = ()  # what its version policy serves (those without an error)
    labels: dict[str, int] = field(default_factory=dict)
    policy: str = "latest 1"  # the version policy, in words (the index says it)
    error: str | None = None  # its config.toml is broken: nothing new of it loads
    traffic: TrafficConfig | None = None  # [traffic]: a canary beside the stable version


class Source(Protocol):
    def scan(self) -> dict[str, ModelPlan]:
        """Every model and its plan, read now (blocking: file system)."""
        ...


class OneModel:
    """``--model``: one model, version 1, the server's own settings."""

    def __init__(self, settings: Settings) -> None:
        name = settings.served_name()
        self._plan = ModelPlan(name, {1: VersionPlan(1, settings)}, selected=(1,))

    def scan(self) -> dict[str, ModelPlan]:
        return {self._plan.name: self._plan}


class Directory:
    """``--model-repository``: ``root/<name>/<version>/`` and ``root/<name>/config.toml``.

    A version directory whose files are not complete is left out while a copy may be under way;
    once a later scan finds them unchanged two poll periods on (without polling: the next scan,
    a load through the API), it will not complete by itself, and its plan lists it with why (a
    ``.keras`` that is not a zip)."""

    def __init__(
        self, root: Path, settings: Settings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.root = root
        self.settings = settings
        self._clock = clock
        # (name, version) -> the fingerprint its incomplete files had when first seen so, and when
        self._incomplete: dict[tuple[str, int], tuple[str, float]] = {}

    def scan(self) -> dict[str, ModelPlan]:
        complete, partial = scan_all(self.root)
        stuck = self._stuck(partial, self._clock())
        plans = {name: self._plan(name, found) for name, found in complete.items()}
        for name, versions in stuck.items():
            listed = {
                v: VersionPlan(v, None, d.fingerprint, _stuck(d)) for v, d in versions.items()
            }
            plans[name] = replace(plans[name], versions={**listed, **plans[name].versions})
        return plans

    def _stuck(
        self, partial: dict[str, dict[int, Incomplete]], now: float
    ) -> dict[str, dict[int, Incomplete]]:
        """The incomplete versions whose files an earlier scan saw as they are, at least two
        poll periods ago."""
        quiet_s = 2 * self.settings.repository_poll_s
        seen: dict[tuple[str, int], tuple[str, float]] = {}
        stuck: dict[str, dict[int, Incomplete]] = {}
        for name, versions in partial.items():
            for v, found in versions.items():
                before = self._incomplete.get((name, v))
                unchanged = before is not None and before[0] == found.fingerprint
                since = before[1] if before is not None and unchanged else now
                seen[(name, v)] = (found.fingerprint, since)
                if unchanged and now - since >= quiet_s:
                    stuck.setdefault(name, {})[v] = found
        self._incomplete = seen
        return stuck

    def _plan(self, name: str, found: dict[int, VersionDir]) -> ModelPlan:
        try:
            config = read_model_config(self.root / name)
        except ConfigError as exc:
            error = str(exc)
            return ModelPlan(name, _unservable(found, error), error=error)
        policy = config.policy
        missing = policy.missing(found)
        if missing:
            log.debug(
                "model %r: versions %s of its policy are not in the repository", name, missing
            )
        versions = {v: VersionPlan(v, None, d.fingerprint) for v, d in found.items()}
        selected = []
        for v in policy.select(found):
            try:
                settings = model_settings(self.settings, name, found[v], config)
            except ConfigError as exc:
                versions[v] = VersionPlan(v, None, found[v].fingerprint, str(exc))
                continue
            versions[v] = VersionPlan(v, settings, found[v].fingerprint)
            selected.append(v)
        return ModelPlan(
            name,
            versions,
            tuple(selected),
            config.labels,
            policy.describe(),
            traffic=config.traffic,
        )


def _stuck(found: Incomplete) -> str:
    return (
        f"its files are incomplete and have stopped changing: {found.reason}; copy the version "
        "whole (into a hidden directory, then rename it into place)"
    )


def _unservable(found: dict[int, VersionDir], error: str) -> dict[int, VersionPlan]:
    return {v: VersionPlan(v, None, d.fingerprint, error) for v, d in found.items()}


def source_for(settings: Settings) -> Source:
    if settings.model_repository is not None:
        return Directory(settings.model_repository, settings)
    return OneModel(settings)


def selected_settings(plans: dict[str, ModelPlan]) -> list[Settings]:
    """The settings of every version the plans select (the private Ray's CPU plan)."""
    selected = [plan.versions[v].settings for plan in plans.values() for v in plan.selected]
    return [settings for settings in selected if settings is not None]


def not_in_repository(name: str, plans: dict[str, ModelPlan]) -> str:
    held = ", ".join(repr(n) for n in sorted(plans)) or "no model"
    return f"model {quote(name)} is not in the model repository; it holds {held}"


def why_retired(plan: ModelPlan, version: str) -> str:
    """Why a served version is retired: gone from disk, or out of its version policy."""
    if int(version) not in plan.versions:
        return REMOVED
    return f"no longer selected by its version policy ({plan.policy})"
