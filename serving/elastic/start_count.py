"""The count a new version of a model starts at: the count its model serves with now.

A version switch keeps the capacity the load needed: where an older version of the model serves
N replicas, the new one starts at N (within its own bounds) instead of at its minimum, and its own
scale steps take it from there. The registry calls ``inherit_count`` as a version is added,
before it loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from serving.settings.config import Settings

if TYPE_CHECKING:
    from serving.version.served import ServedModel
    from shards.pipeline.health import Health

__all__ = ["inherit_count", "serving_count", "start_count"]


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
    ready = [m for m in others if m.serving]
    if ready:
        newest = max(ready, key=lambda m: (len(m.version), m.version))
        model.settings = start_count(model.settings, serving_count(newest.health()))
