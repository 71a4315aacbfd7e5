"""A version's replica scaling and batching limits as plain data: the version holds them,
``serving.elastic`` fills them.

So that ``serving.version`` needs nothing of ``serving.elastic`` (a version holds these, the
elastic steps and the replica switch write them):

- ``ScaleStatus``: what the V2 metadata and the admin view show of an elastic version (its bounds,
  the count it should have and why), ``ServedModel.scaling`` once READY;
- ``ScaleState``: whether another part moves the count for a while (``held``: a version switch
  replica by replica, through ``serving.elastic.steps.hold``), whether the count never changes
  (``fixed``), and the elastic part's own per-version object (``scaler``: the policy's state, the
  desired count, the steps under way), which the version keeps but does not read;
- ``LimitSources``: what each source wants of its batching limits (start-up, the operator's
  admin PUT, the replicas that serve now, a switch's widening), which
  ``serving.elastic.limits.desired_limits`` combines and ``apply_limits`` alone writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serving.batching.settings import BatchSettings

__all__ = ["LimitSources", "ScaleState", "ScaleStatus"]


@dataclass
class ScaleStatus:
    """What the V2 metadata and the admin view show: the bounds, the count the version should
    have and why (the last decision's reason and figures)."""

    minimum: int
    maximum: int
    target: int
    reason: str
    detail: str = ""
    pending: str = ""  # what a replica the cluster has not placed yet waits for, if one

    def parameters(self) -> dict[str, Any]:
        return {
            "min_replicas": self.minimum,
            "max_replicas": self.maximum,
            "target_replicas": self.target,
            "reason": self.reason,
            "detail": self.detail,
            "pending": self.pending,
        }


@dataclass(eq=False)
class ScaleState:
    """One version's replica scaling between two samples (``serving.elastic.steps``)."""

    held: str | None = None  # why another part moves the count now; its steps wait meanwhile
    fixed: bool = False  # judged at READY: its count never changes (bounds, or its runner)
    scaler: object | None = None  # serving.elastic.steps.Scaler, from READY on


@dataclass(eq=False)
class LimitSources:
    """One version's batching limits as desired values, by source (``serving.elastic.limits``):
    ``start``: the flags fitted to its runner at start-up (None before its batcher is made);
    ``operator``: the fields an admin PUT set since (theirs from then on); ``healthy``: the
    replicas that serve now, as the scaling loop or a switch step last saw them (None: as at
    start); ``factor``: a switch of its model widens its queue rows by this much meanwhile."""

    start: BatchSettings | None = None
    operator: dict[str, Any] = field(default_factory=dict)
    healthy: int | None = None
    factor: int = 1
