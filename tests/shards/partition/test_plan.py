"""Stage planning on hand-made cost lists: no TensorFlow, no Ray."""

from __future__ import annotations

import itertools
import random

import pytest

from shards.partition.plan import (
    FLOPS_PER_WEIGHT_BYTE,
    NodeCost,
    PlanError,
    format_bytes,
    plan_balanced,
    plan_budget,
    stage_costs,
)


def flops_nodes(costs: list[int]) -> list[NodeCost]:
    return [NodeCost(f"n{i}", 0, c) for i, c in enumerate(costs)]


def byte_nodes(sizes: list[int]) -> list[NodeCost]:
    return [NodeCost(f"layer_{i}", s, 0) for i, s in enumerate(sizes)]


def brute_force_best(nodes: list[NodeCost], k: int) -> int:
    n = len(nodes)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        plan = list(itertools.pairwise(bounds))
        worst = max(stage_costs(nodes, plan))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


def assert_tiles(plan: list[tuple[int, int]], n: int) -> None:
    assert plan[0][0] == 0 and plan[-1][1] == n
    assert all(a < b for a, b in plan)
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(plan))


@pytest.mark.parametrize(
    ("costs", "k"),
    [
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3),
        ([9, 1, 1, 1, 1, 1, 1, 1, 9], 3),
        ([5, 5, 5, 5], 4),
        ([100, 1, 1, 1, 1, 1], 2),
        ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 4),
        ([0, 0, 0, 7], 3),
    ],
)
def test_balanced_max_stage_cost_is_minimal(costs: list[int], k: int) -> None:
    nodes = flops_nodes(costs)
    plan = plan_balanced(nodes, k)
    assert len(plan) == k
    assert_tiles(plan, len(costs))
    assert max(stage_costs(nodes, plan)) == brute_force_best(nodes, k)


def test_balanced_single_stage_takes_everything() -> None:
    assert plan_balanced(flops_nodes([1, 2, 3]), 1) == [(0, 3)]


def test_balanced_more_stages_than_nodes_is_an_error() -> None:
    with pytest.raises(PlanError, match=r"stages=4 .* 3 cuttable nodes"):
        plan_balanced(flops_nodes([1, 2, 3]), 4)


def test_balanced_rejects_zero_stages() -> None:
    with pytest.raises(PlanError, match="got 0"):
        plan_balanced(flops_nodes([1]), 0)


def test_budget_gives_fewest_stages_that_fit() -> None:
    nodes = byte_nodes([40, 40, 40, 10, 10, 60, 30])
    plan = plan_budget(nodes, 100)
    sizes = [sum(n.param_bytes for n in nodes[a:b]) for a, b in plan]
    assert len(plan) == 3  # 230 bytes need at least 3 stages of 100
    assert all(s <= 100 for s in sizes)
    assert_tiles(plan, len(nodes))


def test_budget_one_stage_when_all_fits() -> None:
    assert plan_budget(byte_nodes([1, 2, 3]), 6) == [(0, 3)]


def test_budget_balances_compute_among_fewest_stages() -> None:
    # Weights force two stages (a and d cannot share one). Packing by bytes alone would cut
    # before d and leave both heavy nodes a and b in stage 0; balancing cuts right after a.
    nodes = [
        NodeCost("a", 50, 1_000),
        NodeCost("b", 0, 1_000),
        NodeCost("c", 0, 0),
        NodeCost("d", 50, 0),
        NodeCost("e", 0, 0),
    ]
    assert plan_budget(nodes, 60) == [(0, 1), (1, 5)]


def test_budget_oversized_layer_is_named() -> None:
    nodes = byte_nodes([10, 5000, 10])
    with pytest.raises(PlanError, match=r"'layer_1'.*4.9 KiB.*max_stage_bytes=1000"):
        plan_budget(nodes, 1000)


def test_cost_weights_bytes_and_flops() -> None:
    assert NodeCost("x", 10, 0).cost == 10 * FLOPS_PER_WEIGHT_BYTE
    assert NodeCost("x", 0, 1).cost > 0


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(2048) == "2.0 KiB"
    assert format_bytes(3 * 1024**3) == "3.0 GiB"


def brute_force_devices(nodes: list[NodeCost], budgets: list[int]) -> int | None:
    """The smallest max stage cost over plans with stage i's weights <= budgets[i]; None if none."""
    n, k = len(nodes), len(budgets)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        plan = list(itertools.pairwise([0, *cuts, n]))
        sizes = [sum(x.param_bytes for x in nodes[a:b]) for a, b in plan]
        if all(s <= b for s, b in zip(sizes, budgets, strict=True)):
            worst = max(stage_costs(nodes, plan))
            best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_one_budget_per_device_fits_each_and_balances_like_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    nodes = [
        NodeCost(f"n{i}", rng.randint(0, 50), rng.randint(0, 20)) for i in range(rng.randint(3, 8))
    ]
    budgets = [rng.randint(20, 150) for _ in range(rng.randint(1, min(4, len(nodes))))]
    if len(budgets) == 1:
        budgets = budgets * 2  # one budget means "fewest stages"; here, per device
    best = brute_force_devices(nodes, budgets)
    if best is None:
        with pytest.raises(PlanError):
            plan_budget(nodes, budgets)
        return
    plan = plan_budget(nodes, budgets)
    assert_tiles(plan, len(nodes))
    assert len(plan) == len(budgets)
    for (a, b), budget in zip(plan, budgets, strict=True):
        assert sum(x.param_bytes for x in nodes[a:b]) <= budget
    assert max(stage_costs(nodes, plan)) == best
