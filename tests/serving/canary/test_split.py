"""WeightedSplit: smooth weighted round robin. Exact shares over one cycle of sum(weights) picks,
spread out rather than in runs, zero weights never picked, bad weights refused."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest

from serving.canary.split import WeightedSplit


def test_90_10_gives_exactly_90_and_10_over_100_picks() -> None:
    split = WeightedSplit({"stable": 90, "canary": 10})
    picks = [split.pick() for _ in range(100)]
    assert Counter(picks) == {"stable": 90, "canary": 10}


def test_shares_are_exact_over_every_cycle_not_only_the_first() -> None:
    split = WeightedSplit({"3": 5, "4": 2, "5": 1})
    for _ in range(4):
        assert Counter(split.pick() for _ in range(8)) == {"3": 5, "4": 2, "5": 1}


def test_the_minority_is_spread_out_not_sent_in_a_run() -> None:
    split = WeightedSplit({"stable": 90, "canary": 10})
    picks = [split.pick() for _ in range(100)]
    at = [i for i, pick in enumerate(picks) if pick == "canary"]
    assert [b - a for a, b in pairwise(at)] == [10] * 9


def test_a_zero_weight_is_never_picked() -> None:
    split = WeightedSplit({"stable": 1, "canary": 0})
    assert {split.pick() for _ in range(50)} == {"stable"}
    assert split.weights == {"stable": 1, "canary": 0}


def test_50_50_alternates() -> None:
    split = WeightedSplit({"stable": 50, "canary": 50})
    assert [split.pick() for _ in range(4)] == ["stable", "canary", "stable", "canary"]


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({}, "at least one key"),
        ({"stable": 0, "canary": 0}, "positive sum"),
        ({"stable": -1, "canary": 2}, "weight of 'stable' must be an integer >= 0, got -1"),
        ({"stable": 1.5}, "got 1.5"),
        ({"stable": True}, "got True"),
    ],
)
def test_bad_weights_are_refused_naming_the_value(weights: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WeightedSplit(weights)
