"""Pure stage planning over a list of per-node costs (no TensorFlow).

The nodes are in topological order and a stage is a contiguous range of them, so a plan is a
list of ``(start, end)`` half-open ranges that tile ``range(len(nodes))``. Two questions:

- ``stages=K``: cut into exactly K stages so that the costliest stage is as cheap as possible
  (the pipeline's throughput is the slowest stage's).
- ``max_stage_bytes=B``: the fewest stages whose weights each fit in B; among the plans with that
  many stages, the one whose costliest stage is cheapest.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shards.errors import PlanError
from shards.partition.memory_plan import DEFAULT_MAX_SEQUENCE_LENGTH
from shards.partition.memory_plan import format_size as format_bytes

Plan = list[tuple[int, int]]

# A batch's time on CPU is roughly its FLOPs over ~50 GFLOP/s plus one read of the weights at
# ~10 GB/s; at the reference batch of 32 rows, one weight byte weighs like 5 FLOPs per batch.
REFERENCE_BATCH = 32
FLOPS_PER_WEIGHT_BYTE = 5


@dataclass(frozen=True)
class NodeCost:
    name: str
    param_bytes: int
    flops_per_row: int

    @property
    def cost(self) -> int:
        return self.flops_per_row * REFERENCE_BATCH + self.param_bytes * FLOPS_PER_WEIGHT_BYTE


def _row_size(tensor: Any, sequence_length: int) -> int:
    # An unknown dimension (a sequence length) counts at the longest a request may bring, as
    # the memory plan counts it: at 1, a layer over positions would weigh like one after pooling.
    return math.prod(sequence_length if d is None else int(d) for d in tuple(tensor.shape)[1:])


def param_bytes(op: Any) -> int:
    """Bytes of an operation's (or a whole model's) weights."""
    return sum(math.prod(w.shape) * _itemsize(str(w.dtype)) for w in getattr(op, "weights", ()))


def _itemsize(dtype: str) -> int:
    sizes = {"float64": 8, "int64": 8, "float16": 2, "bfloat16": 2, "int16": 2, "int8": 1}
    return sizes.get(dtype, 1 if dtype in ("uint8", "bool") else 4)


def estimate_flops(
    op: Any,
    inputs: Sequence[Any],
    outputs: Sequence[Any],
    sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
) -> int:
    """FLOPs per row of one layer call, from shapes: a multiply-add counts 2; a dimension
    unknown in the graph counts as ``sequence_length``.

    Layers with a ``kernel`` (Dense, Conv*, EinsumDense, depthwise) do one multiply-add per kernel
    entry per output position; attention adds the score and weighting products; anything else
    is charged one FLOP per output element plus two per weight (normalisation, activations).
    """
    out_elems = sum(_row_size(t, sequence_length) for t in outputs)
    weights = list(getattr(op, "weights", ()))
    kind = type(op).__name__
    if kind == "MultiHeadAttention" and inputs:
        width = int(tuple(inputs[0].shape)[-1] or 1)
        seq = max(1, _row_size(inputs[0], sequence_length) // width)
        n_params = sum(math.prod(w.shape) for w in weights)
        heads, key_dim = int(op.num_heads), int(op.key_dim)
        return 2 * n_params * seq + 4 * seq * seq * heads * key_dim
    kernel = next((w for w in weights if str(w.path).endswith("kernel")), None)
    if kernel is not None and outputs and tuple(outputs[0].shape)[-1]:
        positions = _row_size(outputs[0], sequence_length) // int(tuple(outputs[0].shape)[-1])
        positions = max(1, positions)
        return 2 * math.prod(kernel.shape) * positions
    return out_elems + 2 * sum(math.prod(w.shape) for w in weights)


def _greedy(costs: Sequence[int], sizes: Sequence[int], max_cost: int, max_size: int) -> Plan:
    """Fill each stage as far as both limits allow: for contiguous ranges this gives the fewest
    stages (any plan's k-th cut is never to the right of the greedy k-th cut)."""
    plan: Plan = []
    start, cost, size = 0, 0, 0
    for i, (c, s) in enumerate(zip(costs, sizes, strict=True)):
        if i > start and (cost + c > max_cost or size + s > max_size):
            plan.append((start, i))
            start, cost, size = i, 0, 0
        cost += c
        size += s
    plan.append((start, len(costs)))
    return plan


def _split_to(plan: Plan, k: int) -> Plan:
    """Split multi-node stages until there are k; splitting never raises a stage's cost."""
    plan = list(plan)
    while len(plan) < k:
        i = next(j for j, (a, b) in enumerate(plan) if b - a > 1)
        a, b = plan[i]
        plan[i : i + 1] = [(a, b - 1), (b - 1, b)]
    return plan


def _min_max_cost(costs: Sequence[int], sizes: Sequence[int], k: int, max_size: int) -> Plan:
    """Binary search the smallest stage-cost cap under which greedy needs at most k stages."""
    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy(costs, sizes, mid, max_size)) <= k:
            hi = mid
        else:
            lo = mid + 1
    return _split_to(_greedy(costs, sizes, lo, max_size), k)


def plan_balanced(nodes: Sequence[NodeCost], stages: int) -> Plan:
    if stages < 1:
        raise PlanError(f"stages must be an integer >= 1, got {stages}")
    if stages > len(nodes):
        raise PlanError(
            f"stages={stages} is more than the model's {len(nodes)} cuttable nodes; "
            f"ask for at most {len(nodes)}"
        )
    costs = [n.cost for n in nodes]
    return _min_max_cost(costs, [0] * len(nodes), stages, max_size=0)


# Bytes a stage over nodes[a:b] needs at its peak, and the same spelled out for an error.
Need = Callable[[int, int], int]
Explain = Callable[[int, int], str]


def budget_text(budgets: Sequence[int]) -> str:
    if len(budgets) == 1:
        return f"max_stage_bytes={budgets[0]} ({format_bytes(budgets[0])})"
    top = max(budgets)
    listed = ",".join(str(b) for b in budgets)
    return f"the largest device budget {top} ({format_bytes(top)}) of max_stage_bytes={listed}"


def _fill(
    costs: Sequence[int], cap: int, fits: Callable[[int, int, int], bool], k: int | None
) -> Plan:
    """Greedy over k devices of one budget (k=None: as many as it takes): stage j takes nodes
    while its cost stays <= cap and it fits, leaving one node for each later stage; the last
    stage takes the rest. With one budget its j-th cut is never left of any fitting plan's (a
    sub-range of a range that fits fits too), so it finds a plan whenever one exists; with
    different budgets it may not (``_reach``)."""
    n = len(costs)
    plan: Plan = []
    start, cost = 0, 0
    for i, c in enumerate(costs):
        j = len(plan)
        last = k is not None and j == k - 1
        reserve = k is not None and n - i == k - 1 - j
        full = cost + c > cap or not fits(j, start, i + 1)
        if i > start and not last and (reserve or full):
            plan.append((start, i))
            start, cost = i, 0
        cost += c
    plan.append((start, n))
    return plan


def _reach(
    costs: Sequence[int], cap: int, fits: Callable[[int, int, int], bool], k: int
) -> tuple[Plan | None, list[dict[int, int]]]:
    """Exactly k stages, stage j fitting device j, each costing <= cap: the cut positions each
    device can reach (with the cut before it), and a plan when the last reaches the end.
    Greedy is not enough with different budgets: going further on a big device can leave a
    layer to a small one that cannot hold it."""
    n = len(costs)
    prefix = list(itertools.accumulate(costs, initial=0))
    reach: list[dict[int, int]] = [{0: -1}]
    for j in range(k):
        nxt: dict[int, int] = {}
        last = n - (k - 1 - j)  # leave a node for each later stage
        end = covered = 0
        for a in sorted(reach[j]):
            # A range inside one that fits fits too, so the furthest end from a later start is
            # never nearer: two pointers, O(n) needs per device.
            end = max(end, a)
            while end < last and prefix[end + 1] - prefix[a] <= cap and fits(j, a, end + 1):
                end += 1
            for b in range(max(covered, a) + 1, end + 1):
                nxt[b] = a
            covered = max(covered, end)
        reach.append(nxt)
    if n not in reach[k]:
        return None, reach
    plan: Plan = []
    end = n
    for j in range(k, 0, -1):
        start = reach[j][end]
        plan.append((start, end))
        end = start
    return plan[::-1], reach


def plan_budget(
    nodes: Sequence[NodeCost],
    max_stage_bytes: int | Sequence[int],
    need: Need | None = None,
    explain: Explain | None = None,
) -> Plan:
    """One budget: the fewest stages whose needs each fit it, the most balanced among them.
    One budget per device: exactly that many stages, stage i fitting device i.

    ``need`` is what a stage needs at its peak (default: its weights only)."""
    budgets = (max_stage_bytes,) if isinstance(max_stage_bytes, int) else tuple(max_stage_bytes)
    if not budgets or any(b < 1 for b in budgets):
        raise PlanError(f"max_stage_bytes must be integers >= 1, got {list(budgets)}")
    if not nodes:
        raise PlanError("the model has no cuttable nodes")

    def weights(a: int, b: int) -> int:
        return sum(n.param_bytes for n in nodes[a:b])

    need = need or weights
    explain = explain or (
        lambda a, b: f"{format_bytes(weights(a, b))} of weights ({weights(a, b)} bytes)"
    )
    for i, node in enumerate(nodes):
        if need(i, i + 1) > max(budgets):
            raise PlanError(
                f"layer {node.name!r} alone holds {explain(i, i + 1)}, more than "
                f"{budget_text(budgets)}; raise the budget to at least {need(i, i + 1)} bytes"
            )
    costs = [n.cost for n in nodes]
    total = sum(costs)
    if len(budgets) == 1:
        k = len(_fill(costs, total, lambda _j, a, b: need(a, b) <= budgets[0], None))
        budgets = budgets * k
    if len(budgets) > len(nodes):
        raise PlanError(
            f"max_stage_bytes lists {len(budgets)} devices but the model has only {len(nodes)} "
            "cuttable nodes; give at most that many budgets"
        )
    k = len(budgets)
    needs: dict[tuple[int, int], int] = {}

    def fits(j: int, a: int, b: int) -> bool:
        if (a, b) not in needs:
            needs[a, b] = need(a, b)
        return needs[a, b] <= budgets[j]

    def feasible(cap: int) -> Plan | None:
        if len(set(budgets)) == 1:  # one budget: greedy fill is optimal, and cheaper
            plan = _fill(costs, cap, fits, k)
            ok = all(fits(j, a, b) and sum(costs[a:b]) <= cap for j, (a, b) in enumerate(plan))
            return plan if ok else None
        return _reach(costs, cap, fits, k)[0]

    best = feasible(total)
    if best is None:
        raise PlanError(_no_fit(nodes, budgets, _reach(costs, total, fits, k)[1], fits, explain))
    lo, hi = max(costs), total
    while lo < hi:
        mid = (lo + hi) // 2
        found = feasible(mid)
        if found is not None:
            hi, best = mid, found
        else:
            lo = mid + 1
    return feasible(lo) or best


def _no_fit(
    nodes: Sequence[NodeCost],
    budgets: Sequence[int],
    reach: list[dict[int, int]],
    fits: Callable[[int, int, int], bool],
    explain: Explain,
) -> str:
    """Why no plan fits the devices in order: how far they get, and the layer that stops them."""
    k = len(budgets)
    j = max(i for i, r in enumerate(reach) if r)  # devices 0..j-1 placed, stage j could start
    pos = max(reach[j])
    head = f"the model does not fit max_stage_bytes={','.join(str(x) for x in budgets)} in order"
    done = f"devices 0..{j - 1} hold at most the layers up to {nodes[pos - 1].name!r}" if j else ""
    fix = "; give the devices more memory, add a device, or order them differently"
    if j == k:
        return f"{head}: {done}, and layer {nodes[pos].name!r} onwards is left over{fix}"
    if not fits(j, pos, pos + 1):
        return (
            f"{head}: {done + ', and ' if done else ''}stage {j}'s device (budget {budgets[j]}, "
            f"{format_bytes(budgets[j])}) cannot hold the next layer {nodes[pos].name!r}, which "
            f"alone holds {explain(pos, pos + 1)}{fix}"
        )
    return f"{head}: {done}, and too few layers are left for the other {k - j} device(s){fix}"


def stage_costs(nodes: Sequence[NodeCost], plan: Plan) -> list[int]:
    return [sum(n.cost for n in nodes[a:b]) for a, b in plan]
