"""Whether more replicas fit in what the cluster has free now: a version switch asks it before
the new version places its replicas beside the old one's (``serving.repository.replica_switch``).

``shards.cluster.check_cluster_fits`` asks whether a pipeline could ever be placed (the cluster's
totals); this asks whether it can be placed now, beside everything already placed: each replica's
bundles (one placement group) packed first-fit onto the nodes' free resources, its strategy
kept (STRICT_PACK: one node; STRICT_SPREAD: one node per bundle; PACK and SPREAD: any nodes).
A look, not a reservation: another job may take the room before the groups are placed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import ray

from shards.cluster import bundle_fits, resource_amount

log = logging.getLogger(__name__)

Resources = dict[str, float]


def replicas_fit(bundles: Sequence[Resources], replicas: int, strategy: str = "PACK") -> str | None:
    """None when ``replicas`` more placement groups of ``bundles`` fit in the cluster's free
    resources now; else one line saying what they ask and what is free."""
    free = [dict(node) for node in _free_per_node()]
    need = {k: v * replicas for b in bundles for k, v in b.items()}
    for done in range(replicas):
        if not place_group(bundles, free, strategy):
            have = ray.available_resources()
            asked = ", ".join(f"{k}={resource_amount(k, v)}" for k, v in sorted(need.items()))
            now = ", ".join(f"{k}={resource_amount(k, have.get(k, 0.0))}" for k in sorted(need))
            return (
                f"{replicas} replica(s) ask {asked} ({strategy}); {done} of them fit in what "
                f"the cluster has free ({now})"
            )
    return None


def place_group(bundles: Sequence[Resources], nodes: list[Resources], strategy: str) -> bool:
    """Take one placement group's bundles out of ``nodes`` (their free resources, changed in
    place) first-fit; False (``nodes`` unchanged) when they do not fit."""
    if strategy == "STRICT_PACK":
        whole: Resources = {}
        for bundle in bundles:
            for key, amount in bundle.items():
                whole[key] = whole.get(key, 0.0) + amount
        return _take([whole], nodes, distinct=False)
    return _take(bundles, nodes, distinct=strategy == "STRICT_SPREAD")


def _take(bundles: Sequence[Resources], nodes: list[Resources], *, distinct: bool) -> bool:
    trial = [dict(node) for node in nodes]
    used: set[int] = set()
    for bundle in bundles:
        found = next(
            (
                i
                for i, node in enumerate(trial)
                if not (distinct and i in used) and bundle_fits(bundle, node)
            ),
            None,
        )
        if found is None:
            return False
        used.add(found)
        for key, amount in bundle.items():
            trial[found][key] = trial[found].get(key, 0.0) - amount
    nodes[:] = trial
    return True


def _free_per_node() -> list[Resources]:
    try:
        from ray._private.state import available_resources_per_node

        per_node = available_resources_per_node()
        return [dict(resources) for resources in per_node.values()]
    except Exception:  # an internal API: without it, the cluster as one node (totals only)
        log.debug("no per-node free resources; judging the cluster's totals", exc_info=True)
        return [dict(ray.available_resources())]
