"""Which version an unversioned request goes to: smooth weighted round robin (nginx's upstream
balancer). Each pick adds every key's weight to its running score, takes the highest, and takes
the total off the winner: over any ``sum(weights)`` picks each key is picked exactly its weight
times, spread out (90/10 is nine stable, one canary, not ninety then ten), with no random draw
for a test to fight."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["CanarySplit", "WeightedSplit"]


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


class CanarySplit:
    """One model's stable version, its canary and their weights: the data the routing pick
    (``serving.repository.routing``) reads for a request that names no version. The canary's
    controller sets it; ``split`` is ``None`` while the canary takes no share (rolled back,
    weight 0, or none)."""

    def __init__(self, stable: str) -> None:
        self.stable = stable
        self.canary: str | None = None
        self.weights = (100, 0)
        self.split: WeightedSplit | None = None

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
