"""A version's replica count: the count it starts at, and the one actuator that changes it.

The count's sources: the operator's settings (``replicas``, its bounds), a switch of its model
(a new version starts at the count its model serves with now: ``start_count``, chosen by the
reconciler as it loads the version; a switch replica by replica starts it at one), and the
autoscaler's decision (``serving.elastic.policy``, acted on by ``serving.elastic.steps``). Every
change of a served version's count, the scaling loop's or a switch step's, goes through
``add_replica``/``remove_replica`` here: the only calls of the runner's (a test says so).

A version switch keeps the capacity the load needed: where an older version of the model serves
N replicas, the new one starts at N (within its own bounds) instead of at its minimum, and its own
scale steps take it from there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from serving.settings.config import Settings

if TYPE_CHECKING:
    from serving.version.runner import ElasticRunner
    from serving.version.served import ServedModel
    from shards.pipeline.health import Health

__all__ = [
    "add_replica",
    "inherited_settings",
    "remove_replica",
    "serving_count",
    "start_count",
]


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


def inherited_settings(settings: Settings, others: Iterable[ServedModel]) -> Settings:
    """A new version's settings, where a version switch keeps the capacity: the count of the
    highest READY version of the model serving now (``start_count``)."""
    ready = [m for m in others if m.takes_requests]
    if not ready:
        return settings
    newest = max(ready, key=lambda m: (len(m.version), m.version))
    return start_count(settings, serving_count(newest.health()))


async def add_replica(model: ServedModel, runner: ElasticRunner) -> bool:
    """One more replica of ``model``: True once it serves, False where it was given up (not
    placed within ``replica_pending_timeout_s``, or it failed to start)."""
    return await runner.add_replica(model.settings.replica_pending_timeout_s)


async def remove_replica(model: ServedModel, runner: ElasticRunner) -> None:
    """One replica fewer, drained within ``drain_timeout_s``."""
    await runner.remove_replica(model.settings.drain_timeout_s)
