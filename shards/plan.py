"""Pure stage planning over a list of per-node costs (no TensorFlow).

The nodes are in topological order and a stage is a contiguous range of them, so a plan is a
list of ``(start, end)`` half-open ranges that tile ``range(len(nodes))``. Two questions:

- ``stages=K``: cut into exactly K stages so that the costliest stage is as cheap as possible
  (the pipeline's throughput is the slowest stage's).
- ``max_stage_bytes=B``: the fewest stages whose weights each fit in B; among the plans with that
  many stages, the one whose costliest stage is cheapest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shards.errors import PlanError

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


def _row_size(tensor: Any) -> int:
    # An unknown dimension (a sequence length) counts as 1: the estimate is per known unit.
    return math.prod(1 if d is None else int(d) for d in tuple(tensor.shape)[1:])


def param_bytes(op: Any) -> int:
    """Bytes of an operation's (or a whole model's) weights."""
    return sum(math.prod(w.shape) * _itemsize(str(w.dtype)) for w in getattr(op, "weights", ()))


def _itemsize(dtype: str) -> int:
    sizes = {"float64": 8, "int64": 8, "float16": 2, "bfloat16": 2, "int16": 2, "int8": 1}
    return sizes.get(dtype, 1 if dtype in ("uint8", "bool") else 4)


def estimate_flops(op: Any, inputs: Sequence[Any], outputs: Sequence[Any]) -> int:
    """FLOPs per row of one layer call, from shapes: a multiply-add counts 2.

    Layers with a ``kernel`` (Dense, Conv*, EinsumDense, depthwise) do one multiply-add per kernel
    entry per output position; attention adds the score and weighting products; anything else
    is charged one FLOP per output element plus two per weight (normalisation, activations).
    """
    out_elems = sum(_row_size(t) for t in outputs)
    weights = list(getattr(op, "weights", ()))
    kind = type(op).__name__
    if kind == "MultiHeadAttention" and inputs:
        seq = max(1, _row_size(inputs[0]) // max(1, int(tuple(inputs[0].shape)[-1] or 1)))
        n_params = sum(math.prod(w.shape) for w in weights)
        heads, key_dim = int(op.num_heads), int(op.key_dim)
        return 2 * n_params * seq + 4 * seq * seq * heads * key_dim
    kernel = next((w for w in weights if str(w.path).endswith("kernel")), None)
    if kernel is not None and outputs and tuple(outputs[0].shape)[-1]:
        positions = max(1, _row_size(outputs[0]) // int(tuple(outputs[0].shape)[-1]))
        return 2 * math.prod(kernel.shape) * positions
    return out_elems + 2 * sum(math.prod(w.shape) for w in weights)


def format_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            break
    return f"{size:.1f} {unit}"


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


def plan_budget(nodes: Sequence[NodeCost], max_stage_bytes: int) -> Plan:
    if max_stage_bytes < 1:
        raise PlanError(f"max_stage_bytes must be an integer >= 1, got {max_stage_bytes}")
    if not nodes:
        raise PlanError("the model has no cuttable nodes")
    for n in nodes:
        if n.param_bytes > max_stage_bytes:
            raise PlanError(
                f"layer {n.name!r} alone holds {format_bytes(n.param_bytes)} of weights "
                f"({n.param_bytes} bytes), more than max_stage_bytes={max_stage_bytes} "
                f"({format_bytes(max_stage_bytes)}); raise the budget to at least "
                f"{n.param_bytes} bytes"
            )
    costs = [n.cost for n in nodes]
    sizes = [n.param_bytes for n in nodes]
    fewest = len(_greedy(costs, sizes, sum(costs), max_stage_bytes))
    return _min_max_cost(costs, sizes, fewest, max_stage_bytes)


def stage_costs(nodes: Sequence[NodeCost], plan: Plan) -> list[int]:
    return [sum(n.cost for n in nodes[a:b]) for a, b in plan]
