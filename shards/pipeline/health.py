"""The health of a group of replicas, as the server reports it (``/readyz``, ``/metrics``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ReplicaState(enum.Enum):
    HEALTHY = "healthy"  # in the rotation
    SUSPECT = "suspect"  # a batch failed on it: out of the rotation while it is probed
    DEAD = "dead"  # its actors are gone: being rebuilt (new placement group and actors)
    STARTING = "starting"  # placed, its actors loading and warming: not in the rotation yet
    PENDING = "pending"  # its placement group waits for resources (a node to come up)
    DRAINING = "draining"  # scaling down: out of the rotation, answering its in-flight batches


@dataclass(frozen=True)
class Health:
    replicas: int
    healthy: int
    # Every replica's state (a ``ReplicaState`` value), in the order the replicas were added.
    states: tuple[str, ...] = ()
    rebuilds: int = 0
    recoveries: int = 0
    # The last fault, one line, for /readyz when no replica is healthy.
    reason: str = ""
    # What a pending replica waits for (``shards.cluster.pending_placement``'s line); "" if none.
    pending_reason: str = ""
    # None is healthy but one is being brought back, with no failure yet: requests may wait for
    # it (``shards.pipeline.replica_set``), and about how long that takes (the last recovery's
    # time, less what has passed of this one).
    recovering: bool = False
    back_in_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.healthy > 0
