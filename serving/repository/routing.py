"""Which version answers a request that names none: one function over the registry's data.

A model's versions and, where it has one, its split of unversioned requests (its ``traffic``):
a canary's (``serving.canary.split.CanarySplit``: its stable version and canary by their
weights) or a version switch replica by replica's (``SwitchSplit``: the old and the new version
by their healthy replicas). The pick is the split's version if that serves, else the highest
version that serves, else the highest (which says why it cannot answer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from serving.canary.split import CanarySplit, WeightedSplit

if TYPE_CHECKING:
    from serving.version.served import ServedModel

__all__ = ["SwitchSplit", "Traffic", "route", "version_key"]


class SwitchSplit:
    """During a switch replica by replica: the old or the new version, in proportion to their
    healthy replicas (``serving.repository.replica_switch``)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self._counts = (-1, -1)
        self._split: WeightedSplit | None = None

    def pick(self, versions: Mapping[str, ServedModel]) -> str:
        counts = (_healthy(versions.get(self.old)), _healthy(versions.get(self.new)))
        if counts != self._counts:  # a replica came or went: shares follow
            self._counts = counts
            weights = {self.old: counts[0], self.new: counts[1]}
            self._split = WeightedSplit(weights) if sum(counts) else None
        return self.new if self._split is None else self._split.pick()

    def peek(self) -> str:
        old, new = self._counts
        return self.old if old >= new else self.new


Traffic = CanarySplit | SwitchSplit


def route(
    versions: Mapping[str, ServedModel], traffic: Traffic | None, *, turn: bool = True
) -> ServedModel:
    """The version of one model (``versions``, not empty) that a request naming no version goes
    to; ``turn=False`` looks without taking a turn of the split (a look before the request's
    own)."""
    if traffic is None and len(versions) == 1:
        # The only version, serving or not (it then says why it cannot answer), as below; without
        # asking its replicas' health twice per request (the protocol's look, the data plane's).
        for only in versions.values():
            return only
    if traffic is not None:
        if isinstance(traffic, SwitchSplit):
            wanted = traffic.pick(versions) if turn else traffic.peek()
        else:
            wanted = traffic.pick() if turn else traffic.peek()
        picked = versions.get(wanted)
        if picked is not None and picked.available:
            return picked
    ordered = sorted(versions.values(), key=lambda m: version_key(m.version))
    ready = [m for m in ordered if m.available]
    return (ready or ordered)[-1]


def version_key(version: str) -> tuple[int, str]:
    """Versions are positive integers as strings: "10" after "9"."""
    return (int(version), "") if version.isdigit() else (0, version)


def _healthy(model: ServedModel | None) -> int:
    if model is None:
        return 0
    health = model.health()
    return health.healthy if health is not None and model.takes_requests else 0
