"""Plan a model's stages and cut them: where to cut (balanced, or within memory budgets, a layer
too large for any device split first: ``shards.partition.oversized``), each stage's sub-model and
its spec with its share of the memory plan. What ``shardserve plan`` prints and
``shards.partition.cut`` writes.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import keras

from shards.bundle.format import StageMemory, StageSpec
from shards.dtypes import check_reduced
from shards.errors import PlanError
from shards.partition.graph import Graph, PartitionError, cut
from shards.partition.memory_plan import MemoryModel, default_overhead, parse_budgets
from shards.partition.oversized import held_beside, memory_like, part_nodes, split_oversized
from shards.partition.plan import Plan, plan_balanced, plan_budget
from shards.split import (
    DEFAULT_LOOKUP_COMBINE,
    DriverCombine,
    Split,
    StagePart,
    check_lookup_combine,
    describe,
    place_labels,
)

__all__ = ["DEFAULT_PLAN_BATCH_ROWS", "Budgets", "Planned", "plan", "plan_bundle", "plan_stages"]

# The server's default max_batch_size (serving.settings.config): the batch a plan sizes
# activations at.
DEFAULT_PLAN_BATCH_ROWS = 32


Budgets = int | Sequence[int]


def plan(
    graph: Graph,
    *,
    stages: int | None,
    max_stage_bytes: Budgets | None,
    memory: MemoryModel | None = None,
    isolated: frozenset[int] = frozenset(),
) -> Plan:
    """The cuts: ``stages`` balanced ones, or the fewest (one budget) or exactly one per device
    (a list of budgets) whose peak needs fit; without ``memory`` a budget counts weights only.
    A node in ``isolated`` (a part of a split layer) is a stage of its own."""
    costs = [n.cost for n in graph.nodes]

    def alone(a: int, b: int) -> bool:
        return b - a == 1 or not any(i in isolated for i in range(a, b))

    if stages is not None and max_stage_bytes is not None:
        raise PartitionError(
            f"give stages ({stages}) or max_stage_bytes ({max_stage_bytes}), not both"
        )
    if max_stage_bytes is not None:
        if memory is None:
            return plan_budget(costs, max_stage_bytes)
        return plan_budget(
            costs,
            max_stage_bytes,
            need=lambda a, b: memory.need(a, b).total if alone(a, b) else sys.maxsize,
            explain=lambda a, b: memory.need(a, b).explain(),
        )
    return plan_balanced(costs, 1 if stages is None else stages)


def _tf_sees_gpu() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def plan_stages(
    graph: Graph,
    *,
    stages: int | None = None,
    max_stage_bytes: Budgets | None = None,
    plan_batch_rows: int = DEFAULT_PLAN_BATCH_ROWS,
    device_overhead_bytes: int | None = None,
    weight_dtype: str | None = None,
) -> list[tuple[keras.Model, StageSpec]]:
    """Plan and cut: each stage's sub-model and its spec (``plan_bundle``'s stages)."""
    return plan_bundle(
        graph,
        stages=stages,
        max_stage_bytes=max_stage_bytes,
        plan_batch_rows=plan_batch_rows,
        device_overhead_bytes=device_overhead_bytes,
        weight_dtype=weight_dtype,
    ).stages


@dataclass(frozen=True)
class Planned:
    """A plan cut: each stage's sub-model and spec, and the model outputs the driver joins from
    a split layer's parts (``shards.split``)."""

    stages: list[tuple[keras.Model, StageSpec]]
    combines: tuple[DriverCombine, ...] = ()


def plan_bundle(
    graph: Graph,
    *,
    stages: int | None = None,
    max_stage_bytes: Budgets | None = None,
    plan_batch_rows: int = DEFAULT_PLAN_BATCH_ROWS,
    device_overhead_bytes: int | None = None,
    weight_dtype: str | None = None,
    lookup_combine: str = DEFAULT_LOOKUP_COMBINE,
    pair_dense: bool = True,
    tied_tables: str = "once",
) -> Planned:
    """Plan and cut: each stage's sub-model and its spec, memory plan included (what
    ``partition`` writes and ``shardserve plan`` prints). ``device_overhead_bytes=None``: the
    default for a GPU when TensorFlow sees one here, else for a CPU. ``weight_dtype``: the
    weights will be served in it (``--weight-dtype``), and count at its size. A dimension
    unknown in the graph counts as ``graph.sequence_length``. ``lookup_combine``: how a table
    split by rows is joined (``shards.split.split_model``: ``routed`` or ``dense``).
    ``pair_dense=False``: no column- then row-split pairs (``shards.split.choose_splits``; for the
    split bench's side-by-side figure, not a user setting).
    ``tied_tables``: a tied table split is held ``once`` (part k's lookup and logits in one
    actor, ``StagePart.held_by``) or ``twice`` (a set of parts for each use)."""
    overhead = device_overhead_bytes
    if overhead is None:
        overhead = default_overhead(gpu=_tf_sees_gpu())
    weight_dtype = check_reduced(weight_dtype, "weight_dtype")
    check_lookup_combine(lookup_combine)
    if stages is not None and max_stage_bytes is not None:
        raise PartitionError(
            f"give stages ({stages}) or max_stage_bytes ({max_stage_bytes}), not both"
        )
    memory = MemoryModel(graph, plan_batch_rows, overhead, weight_dtype, graph.sequence_length)
    budgets = None if max_stage_bytes is None else parse_budgets(max_stage_bytes)
    whole = graph
    splits: list[Split] = []
    combines: tuple[DriverCombine, ...] = ()
    if budgets is not None:
        graph, memory, splits, combines = split_oversized(
            graph, memory, budgets, lookup_combine, pair_dense, tied_tables
        )
    parts = part_nodes(graph, splits)
    try:
        stage_plan = plan(
            graph,
            stages=stages,
            max_stage_bytes=budgets,
            memory=memory,
            isolated=frozenset(parts),
        )
    except PlanError as exc:
        if not splits:
            raise
        if len(budgets or ()) > 1:
            # Split, the model needs more devices than the list gives: the unsplit plan's
            # refusal names the layer that fits none of them.
            plan(whole, stages=stages, max_stage_bytes=budgets, memory=memory_like(whole, memory))
        done = "; ".join(describe(s) for s in splits)
        raise PlanError(f"{exc.message} (with {done})") from None
    labels = place_labels(
        [parts.get(start) if end - start == 1 else None for start, end in stage_plan]
    )
    stage_parts = [parts.get(start) if end - start == 1 else None for start, end in stage_plan]
    stage_parts = _held_by(stage_parts)
    beside = held_beside(parts, memory)
    cut_stages = []
    for index, (start, end) in enumerate(stage_plan):
        stage, spec = cut(graph, start, end, index)
        part = stage_parts[index]
        spec = replace(spec, label=labels[index], part=part)
        need = memory.need(start, end)
        budget = None if budgets is None else budgets[min(index, len(budgets) - 1)]
        spec = replace(
            spec,
            memory=StageMemory(
                first_layer=graph.nodes[start].name,
                last_layer=graph.nodes[end - 1].name,
                activation_bytes=need.activation_bytes,
                overhead_bytes=need.overhead_bytes,
                plan_batch_rows=plan_batch_rows,
                budget_bytes=budget,
                crossing_bytes_per_row=memory.crossing_bytes_per_row(start, end),
                unknown_dims=need.unknown_dims,
                weight_dtype=weight_dtype,
                weight_bytes=None if weight_dtype is None else need.weight_bytes,
                sequence_length=graph.sequence_length,
            ),
        )
        # A lookup part held once runs its logits too: their activations beside its own.
        if budget is not None and spec.planned_peak_bytes + beside.get(start, 0) > budget:
            # A guard: planning charges a reused layer's weights at every call
            # (shards.partition.graph),
            # so the stage cut holds no more than planned.
            raise PartitionError(
                f"stage {index} needs {spec.planned_peak_bytes} bytes ({spec.param_bytes} of "
                f"weights), over its budget {budget}; raise the budget"
            )
        cut_stages.append((stage, spec))
    return Planned(cut_stages, combines)


def _held_by(parts: list[StagePart | None]) -> list[StagePart | None]:
    """Each logits part of a table held once (``held_by`` set, stage unknown when the splits
    were made) given the stage index of its lookup part."""
    lookups = {(p.layer, p.part): i for i, p in enumerate(parts) if p is not None and p.use is None}
    return [
        p if p is None or p.held_by is None else replace(p, held_by=lookups[(p.layer, p.part)])
        for p in parts
    ]
