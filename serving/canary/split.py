"""Which version an unversioned request goes to.

``WeightedSplit``: smooth weighted round robin (nginx's upstream balancer), for a replica
switch's versions. Each pick adds every key's weight to its running score, takes the highest,
and takes the total off the winner: over any ``sum(weights)`` picks each key is picked exactly
its weight times, spread out (90/10 is nine stable, one canary, not ninety then ten).

``RandomSplit``: a draw per request, for a canary. A round robin is predictable: a client that
sends every tenth request, or that sees which version answered its last one, chooses the side
its next request lands on, and can fail the canary's share alone (a rollback) or the stable's
(a broken canary promoted). A draw from the operating system's generator gives a client's
request the same chance of either side, whatever it sends or has seen."""

from __future__ import annotations

import random
from collections.abc import Mapping

__all__ = ["CanarySplit", "RandomSplit", "WeightedSplit"]

# Where a split draws unless given a generator: the tests of a whole server seed it here.
_system_random = random.SystemRandom


class WeightedSplit:
    def __init__(self, weights: Mapping[str, int]) -> None:
        if not weights:
            raise ValueError("weights must name at least one key")
        for key, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
                raise ValueError(f"weight of {key!r} must be an integer >= 0, got {weight!r}")
        self._given = dict(weights)
        # Zero weights never win a pick: leaving them out keeps the loop short.
        self._weights = {k: w for k, w in weights.items() if w > 0}
        if not self._weights:
            raise ValueError(f"weights must have a positive sum, got {self._given!r}")
        self._total = sum(self._weights.values())
        self._current = dict.fromkeys(self._weights, 0)

    @property
    def weights(self) -> dict[str, int]:
        """The weights as given, zeros included."""
        return dict(self._given)

    def pick(self) -> str:
        current = self._current
        best = ""
        best_score = None
        for key, weight in self._weights.items():
            score = current[key] + weight
            current[key] = score
            # Ties go to the first key given (the stable one, by the caller's order).
            if best_score is None or score > best_score:
                best, best_score = key, score
        current[best] -= self._total
        return best


class RandomSplit:
    """Two keys and their weights; each pick a draw. ``rng``: a seeded ``random.Random`` in
    tests and simulations; by default the system's generator (0.5 us a draw), whose next draw
    no client can compute from the ones it saw."""

    def __init__(self, weights: Mapping[str, int], rng: random.Random | None = None) -> None:
        self._checked = WeightedSplit(weights)  # the same refusals of bad weights
        (first, w_first), (second, w_second) = self._pair(weights)
        self._first, self._second = first, second
        self._threshold = w_first / (w_first + w_second)
        self._draw = (rng or _system_random()).random

    @staticmethod
    def _pair(weights: Mapping[str, int]) -> list[tuple[str, int]]:
        pairs = list(weights.items())
        if len(pairs) != 2:
            raise ValueError(f"a random split takes two keys, got {sorted(weights)!r}")
        return pairs

    @property
    def weights(self) -> dict[str, int]:
        return self._checked.weights

    def pick(self) -> str:
        return self._first if self._draw() < self._threshold else self._second


class CanarySplit:
    """One model's stable version, its canary and their weights: the data the routing pick
    (``serving.repository.routing``) reads for a request that names no version. The canary's
    controller sets it; ``split`` is ``None`` while the canary takes no share (rolled back,
    weight 0, or none)."""

    def __init__(self, stable: str) -> None:
        self.stable = stable
        self.canary: str | None = None
        self.weights = (100, 0)
        self.split: RandomSplit | None = None

    def pick(self) -> str:
        """The version the next unversioned request goes to (takes a turn of the split)."""
        split = self.split
        return self.stable if split is None else split.pick()

    def peek(self) -> str:
        """The version the next ``pick`` would most likely give, without taking a turn."""
        if self.split is None or self.canary is None:
            return self.stable
        stable, canary = self.weights
        return self.stable if stable >= canary else self.canary
