"""The health of a group of replicas, as the server reports it (``/readyz``, ``/metrics``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ReplicaState(enum.Enum):
    HEALTHY = "healthy"  # in the rotation
    SUSPECT = "suspect"  # a batch failed on it: out of the rotation while it is probed
    DEAD = "dead"  # its actors are gone: being rebuilt (new placement group and actors)


@dataclass(frozen=True)
class Health:
    replicas: int
    healthy: int
    states: tuple[str, ...] = ()
    rebuilds: int = 0
    recoveries: int = 0
    # The last fault, one line, for /readyz when no replica is healthy.
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.healthy > 0
