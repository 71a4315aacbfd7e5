"""The planner's use of split layers (``shards.split``): each layer too large for the largest
budget split into the fewest parts that fit it, the model rewritten and its graph analysed anew,
a part the memory model finds over given one more; and which node of the new graph is which part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from shards.errors import PlanError
from shards.partition.graph import Graph, reanalyse
from shards.partition.memory_plan import MemoryModel
from shards.partition.plan import budget_text
from shards.split import (
    DEFAULT_LOOKUP_COMBINE,
    LOGITS,
    DriverCombine,
    Split,
    StagePart,
    choose_splits,
    hand_to_driver,
    pair_parts_needed,
    parts_needed,
    reads_own_rows,
    routes,
    split_model,
    use_weight_bytes,
    uses,
)

__all__ = ["held_beside", "memory_like", "part_nodes", "split_oversized"]


def memory_like(graph: Graph, memory: MemoryModel) -> MemoryModel:
    return MemoryModel(
        graph,
        memory.plan_batch_rows,
        memory.overhead_bytes,
        memory.weight_dtype,
        graph.sequence_length,
    )


def split_oversized(
    graph: Graph,
    memory: MemoryModel,
    budgets: Sequence[int],
    lookup_combine: str = DEFAULT_LOOKUP_COMBINE,
    pair_dense: bool = True,
    tied_tables: str = "once",
) -> tuple[Graph, MemoryModel, list[Split], tuple[DriverCombine, ...]]:
    """``graph`` with each layer too large for the largest budget split into the fewest parts
    that fit it (``shards.split``); the same graph where none is too large. A split
    layer whose combine would be a model output and nothing else is joined by the driver
    instead (the combines returned): its parts' outputs are the graph's outputs. A routed
    lookup's parts and a pair's parts are counted as the memory model then counts them: the
    rows a routed part finds at their worst case, a pair's hidden slice (``shards.split``).
    ``pair_dense=False``: two ``Dense`` layers that would pair are split alone
    (``choose_splits``). ``tied_tables``: a tied table's two uses served by one set of parts
    (``once``: each part charged its rows once and both uses' activations) or by a set each
    (``twice``)."""
    top = max(budgets)

    def over(i: int) -> tuple[int, str] | None:
        need = memory.need(i, i + 1)
        return (need.total, need.explain()) if need.total > top else None

    calls: dict[int, list[object]] = {}
    for gnode in graph.nodes:
        calls.setdefault(id(gnode.node.operation), []).append(gnode.node)

    def parts_for(i: int, op: object, how: str) -> int | None:
        # A tied table's lookups and its logits are split at the same rows, each use's parts
        # holding them (shards.split): the count is the larger of the two uses', each use
        # charged the matrix it reads (an untied table's own reverse table for its logits).
        weights = memory.need(i, i + 1).weight_bytes
        found = uses(calls[id(op)], how)
        if tied_tables == "once" and len(found) > 1 and reads_own_rows(op):
            # Held once: one set of parts holds the rows for both uses, and runs both at once.
            (use_how, nodes), *beside = found
            found, also = [(use_how, nodes)], beside
        else:
            also = []
        counts = [
            parts_needed(
                op,
                use_how,
                nodes,
                use_weight_bytes(op, weights, reversed_use(nodes)),
                memory.overhead_bytes,
                memory.plan_batch_rows,
                graph.sequence_length,
                top,
                routes(op, use_how, nodes, graph.model.outputs, lookup_combine),
                beside=also,
            )
            for use_how, nodes in found
        ]
        return None if None in counts else max(c for c in counts if c is not None)

    index = {id(gnode.node): i for i, gnode in enumerate(graph.nodes)}

    def pair_parts(first: Any, second: Any) -> int | None:
        weights = sum(
            memory.need(index[id(n)], index[id(n)] + 1).weight_bytes for n in (first, second)
        )
        return pair_parts_needed(
            first,
            second,
            weights,
            memory.overhead_bytes,
            memory.plan_batch_rows,
            graph.sequence_length,
            top,
        )

    splits = choose_splits(
        graph.nodes,
        over,
        parts_for,
        budget_text(budgets),
        graph.model.outputs,
        pair_parts,
        pair_dense=pair_dense,
        tied_tables=tied_tables,
    )
    for _ in range(8):
        if not splits:
            return graph, memory, [], ()
        split, handed = hand_to_driver(split_model(graph.model, splits, lookup_combine))
        names, combines = _driver_names(graph.signature.output_names, handed)
        split_graph = reanalyse(graph, split, names)
        split_memory = memory_like(split_graph, memory)
        parts = part_nodes(split_graph, splits)
        # The count was computed from shapes; a part the memory model finds over gets one more
        # (a part held once with its logits: its need plus theirs, less their rows).
        beside = held_beside(parts, split_memory)
        grow = {
            p.layer
            for i, p in parts.items()
            if split_memory.need(i, i + 1).total + beside.get(i, 0) > top
            and p.parts < splits_by(splits)[p.layer].size
        }
        if not grow:
            return split_graph, split_memory, splits, combines
        splits = [s.more() if s.layer in grow else s for s in splits]
    raise PlanError(f"cannot split {', '.join(s.layer for s in splits)} to fit {top} bytes")


def _driver_names(
    outputs: Sequence[str], handed: Mapping[int, DriverCombine]
) -> tuple[list[str], tuple[DriverCombine, ...]]:
    """The split model's output names (a handed output's parts named after their layers) and
    the combines, named."""
    names: list[str] = []
    combines: list[DriverCombine] = []
    for i, name in enumerate(outputs):
        if i not in handed:
            names.append(name)
            continue
        names.extend(handed[i].parts)
        combines.append(replace(handed[i], output=name))
    return names, tuple(combines)


def held_beside(parts: Mapping[int, StagePart], memory: MemoryModel) -> dict[int, int]:
    """Node index of a lookup part held once -> the activations its logits part adds to it
    (their rows are its own)."""
    lookups = {(p.layer, p.part): i for i, p in parts.items() if p.use is None}
    return {
        lookups[(p.layer, p.part)]: memory.need(i, i + 1).activation_bytes
        for i, p in parts.items()
        if p.use == LOGITS and p.held_by is not None and (p.layer, p.part) in lookups
    }


def splits_by(splits: Sequence[Split]) -> dict[str, Split]:
    return {s.layer: s for s in splits}


def part_nodes(graph: Graph, splits: Sequence[Split]) -> dict[int, StagePart]:
    """Node index -> the part of a split layer it is."""
    names = {
        s.part_name(k, use): StagePart(
            s.layer,
            s.kind,
            s.how,
            k,
            s.parts,
            s.bounds[k],
            s.bounds[k + 1],
            use,
            # The lookup part's stage is set once the stages are cut (``shards.partition.stages``).
            held_by=-1 if use == LOGITS and s.held_once else None,
        )
        for s in splits
        for use in (None, LOGITS)
        if use is None or s.reversed
        for k in range(s.parts)
    }
    return {i: names[n.name] for i, n in enumerate(graph.nodes) if n.name in names}


def reversed_use(nodes: Sequence[Any]) -> bool:
    """Whether a use's calls are a table's logits (``reverse=True``)."""
    return any(bool(n.arguments.kwargs.get("reverse")) for n in nodes)
