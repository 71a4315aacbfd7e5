"""A layer larger than one device, split into the fewest parts that each fit one.

The planner cuts a model between layers; a layer whose weights plus activations at the max
batch exceed the device budget cannot be one stage. It is rewritten instead: the layer's calls
become one call of each part (``shards.partition.split_layers``) and, per call, a combine; the
planner then gives each part a stage of its own (``isolated``), and the combine runs at the
start of the stage that reads the layer's output (or at the driver's last stage). Parts read the
same tensors and not each other's outputs, so the pipeline runs them at the same time.

- ``Embedding`` (``mask_zero`` too) and keras_hub's ``ReversibleEmbedding`` used forward: by
  rows, each part a vocabulary range; the combine adds the parts (exact).
- ``Dense`` and ``EinsumDense``: by output units; the combine concatenates, then activates.

Any other kind too large is refused by name, with its size, the budget and the kinds that can
be split.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from shards.errors import PlanError
from shards.partition.flatten import topological_nodes
from shards.partition.memory_plan import format_size, row_bytes
from shards.partition.split_layers import KernelColumns, SplitCombine, TableRows, einsum_letters

SPLITTABLE = "Embedding (mask_zero too), keras_hub's ReversibleEmbedding, Dense and EinsumDense"
PART_MARK = "_part"


@dataclass(frozen=True)
class Split:
    """One layer split: how (``rows`` or ``columns``), its parts' ranges along that axis."""

    layer: str
    kind: str
    how: str
    size: int  # rows of the table, or output units
    bounds: tuple[int, ...]  # parts' ranges: [bounds[k], bounds[k + 1])

    @property
    def parts(self) -> int:
        return len(self.bounds) - 1

    def more(self) -> Split:
        """The same layer in one more part."""
        bounds = bounds_for(self.size, self.parts + 1)
        return Split(self.layer, self.kind, self.how, self.size, bounds)

    def part_name(self, k: int) -> str:
        return f"{self.layer}{PART_MARK}{k}of{self.parts}"


def _kind(op: Any) -> str | None:
    """``rows``, ``columns`` or None (cannot be split)."""
    if isinstance(op, keras.layers.Embedding):
        return "rows"
    if isinstance(op, keras.layers.Dense | keras.layers.EinsumDense):
        return "columns"
    return None


def _reversed_call(nodes: Sequence[Any]) -> bool:
    return any(n.arguments.kwargs.get("reverse") for n in nodes)


def _units_axis(op: Any) -> tuple[str, int, int]:
    """An EinsumDense's output-units letter, its kernel axis and its size: the last letter of
    the output that the kernel has and the input has not."""
    kernel = tuple(op.kernel.shape)
    ranks = [len(op.input.shape) if hasattr(op, "input") else len(kernel), len(kernel)]
    (x, k), out = einsum_letters(op.equation, ranks)
    letters = [c for c in out if c in k and c not in x]
    if not letters:
        raise PlanError(
            f"layer {op.name!r} (EinsumDense {op.equation!r}) has no output axis of its own to "
            "split; raise the budget"
        )
    letter = letters[-1]
    return letter, k.index(letter), kernel[k.index(letter)]


def _size(op: Any, how: str) -> int:
    if how == "rows":
        return int(op.input_dim)
    if isinstance(op, keras.layers.Dense):
        return int(op.units)
    return _units_axis(op)[2]


def bounds_for(size: int, parts: int) -> tuple[int, ...]:
    return tuple(k * size // parts for k in range(parts + 1))


def refuse(op: Any, need_text: str, budget_text: str, need: int) -> PlanError:
    """The refusal of a layer too large that cannot be split, by name and kind."""
    return PlanError(
        f"layer {op.name!r} alone holds {need_text}, more than {budget_text}; raise the budget "
        f"to at least {need} bytes. A {type(op).__name__} cannot be split across devices: the "
        f"kinds that can are {SPLITTABLE}"
    )


def parts_needed(
    op: Any,
    how: str,
    calls: Sequence[Any],
    weight_bytes: int,
    overhead: int,
    batch: int,
    sequence_length: int,
    budget: int,
) -> int | None:
    """The fewest parts whose weights and activations each fit ``budget``; None when no number
    does (the activations and overhead alone are over it). By rows every part writes the whole
    output (zeros outside its rows); by columns its share of it."""
    held = out = 0
    for node in calls:
        for t in {id(t): t for t in node.input_tensors}.values():
            held += row_bytes(tuple(t.shape), str(t.dtype), sequence_length)[0]
        for t in node.outputs:
            out += row_bytes(tuple(t.shape), str(t.dtype), sequence_length)[0]
    size = _size(op, how)
    for parts in range(2, size + 1):
        share = math.ceil(weight_bytes / parts)
        output = out if how == "rows" else math.ceil(out / parts)
        if share + (held + output) * batch + overhead <= budget:
            return parts
        if how == "rows" and (held + output) * batch + overhead > budget:
            return None
    return None


def _part_layers(op: Any, split: Split) -> list[keras.layers.Layer]:
    """The parts of ``op``, each built and holding its slice of the weights."""
    layers: list[keras.layers.Layer] = []
    for k in range(split.parts):
        a, b = split.bounds[k], split.bounds[k + 1]
        name, policy = split.part_name(k), op.dtype_policy
        part: keras.layers.Layer
        if split.how == "rows":
            table = keras.ops.convert_to_numpy(op.embeddings)
            part = TableRows(a, b - a, table.shape[1], name=name, dtype=policy)
            part.build(None)
            part.embeddings.assign(table[a:b])
        else:
            kernel = keras.ops.convert_to_numpy(op.kernel)
            bias = None if op.bias is None else keras.ops.convert_to_numpy(op.bias)
            if isinstance(op, keras.layers.Dense):
                k_slice, b_slice, equation = kernel[:, a:b], None, None
                if bias is not None:
                    b_slice = bias[a:b]
            else:
                equation = op.equation
                _, axis, _ = _units_axis(op)
                k_slice = np.take(kernel, np.arange(a, b), axis=axis)
                b_slice = None if bias is None else _bias_slice(op, bias, a, b)
            part = KernelColumns(
                k_slice.shape,
                None if b_slice is None else b_slice.shape,
                equation,
                name=name,
                dtype=policy,
            )
            part.build(None)
            part.kernel.assign(k_slice)
            if b_slice is not None:
                part.bias.assign(b_slice)
        layers.append(part)
    return layers


def _bias_slice(op: Any, bias: np.ndarray, a: int, b: int) -> np.ndarray:
    """An EinsumDense bias is broadcast against the output from the right: slice it on the
    units axis where it has one."""
    letter, _, size = _units_axis(op)
    out_rank = len(op.output.shape) if hasattr(op, "output") else bias.ndim
    ranks = [out_rank, len(op.kernel.shape)]
    _, out = einsum_letters(op.equation, ranks)
    axis = out.index(letter) - (len(out) - bias.ndim)
    if axis < 0 or bias.shape[axis] != size:
        return bias
    return np.take(bias, np.arange(a, b), axis=axis)


def _combine(op: Any, split: Split, node: Any, call: int) -> SplitCombine:
    # Named as the layer was, so a model output keeps its name; a second call's combine after it.
    name = op.name if call == 0 else f"{op.name}_call{call + 1}"
    if split.how == "rows":
        return SplitCombine("add", mask_zero=bool(op.mask_zero), name=name, dtype=op.dtype_policy)
    axis = -1
    if isinstance(op, keras.layers.EinsumDense):
        letter, _, _ = _units_axis(op)
        ranks = [len(node.input_tensors[0].shape), len(op.kernel.shape)]
        _, out = einsum_letters(op.equation, ranks)
        axis = out.index(letter) - len(out)
    return SplitCombine(
        "concat", axis=axis, activation=op.activation, name=name, dtype=op.dtype_policy
    )


def _owner(tensor: Any) -> Any:
    op, index, _ = tensor._keras_history
    return op._inbound_nodes[index]


def _order(nodes: list[Any], split_ops: set[int]) -> list[list[Any]]:
    """Topological order with each split layer's calls as one step (its part serves them all);
    stable: otherwise the order the nodes came in. ``PlanError`` when one call of a split layer
    reads what another call makes (a tied embedding's reverse use: not split yet)."""
    group = {id(n): (id(n.operation) if id(n.operation) in split_ops else id(n)) for n in nodes}
    members: dict[int, list[Any]] = {}
    for n in nodes:
        members.setdefault(group[id(n)], []).append(n)
    first = {g: min(nodes.index(m) for m in ms) for g, ms in members.items()}
    after: dict[int, set[int]] = {g: set() for g in members}
    waits: dict[int, int] = dict.fromkeys(members, 0)
    for n in nodes:
        for t in [*n.input_tensors, *(m for t in n.input_tensors if (m := _mask(t)) is not None)]:
            parent = _owner(t)
            if parent.is_input or id(parent) not in group:
                continue
            a, b = group[id(parent)], group[id(n)]
            if a == b:
                raise PlanError(
                    f"layer {n.operation.name!r} is called on its own output (a tied embedding's "
                    "reverse use); splitting it is not supported yet: raise the budget"
                )
            if b not in after[a]:
                after[a].add(b)
                waits[b] += 1
    ready = [(first[g], g) for g, w in waits.items() if w == 0]
    heapq.heapify(ready)
    order: list[list[Any]] = []
    while ready:
        _, g = heapq.heappop(ready)
        order.append(members[g])
        for b in after[g]:
            waits[b] -= 1
            if waits[b] == 0:
                heapq.heappush(ready, (first[b], b))
    if len(order) != len(members):
        raise PlanError(
            "a split layer's calls depend on each other's outputs (a tied embedding's reverse "
            "use); splitting it is not supported yet: raise the budget"
        )
    return order


def _mask(tensor: Any) -> Any:
    from shards.partition.flatten import mask_of

    return mask_of(tensor)


def split_model(model: keras.Model, splits: Sequence[Split]) -> keras.Model:
    """``model`` with each layer of ``splits`` replaced by its parts and a combine per call."""
    by_name = {s.layer: s for s in splits}
    nodes = topological_nodes(model.outputs)
    split_ops = {id(n.operation) for n in nodes if n.operation.name in by_name}
    values: dict[int, Any] = {}
    inputs = []
    for tensor in model.inputs:
        new = keras.Input(batch_shape=tensor.shape, dtype=tensor.dtype, name=tensor.name)
        values[id(tensor)] = new
        inputs.append(new)

    def substitute(value: Any) -> Any:
        return values[id(value)] if isinstance(value, keras.KerasTensor) else value

    for step in _order(nodes, split_ops):
        op = step[0].operation
        if id(op) not in split_ops:
            (node,) = step
            args = keras.tree.map_structure(substitute, node.arguments.args)
            kwargs = keras.tree.map_structure(substitute, node.arguments.kwargs)
            made = keras.tree.flatten(op(*args, **kwargs))
            for old, new in zip(node.outputs, made, strict=True):
                values[id(old)] = new
            continue
        split = by_name[op.name]
        reads = [substitute(node.arguments.args[0]) for node in step]
        outs = [keras.tree.flatten(part(reads)) for part in _part_layers(op, split)]
        for c, node in enumerate(step):
            combine = _combine(op, split, node, c)
            pieces = [o[c] for o in outs]
            joined = combine([reads[c], *pieces] if combine.mask_zero else pieces)
            values[id(node.outputs[0])] = joined
    return keras.Model(inputs, [values[id(t)] for t in model.outputs], name=model.name)


def choose_splits(
    nodes: Sequence[Any],
    over: Callable[[int], tuple[int, str] | None],
    parts_for: Callable[[int, Any, str], int | None],
    budget_text: str,
) -> list[Split]:
    """The layers to split and into how many parts. ``over(i)``: node i's need and its text when
    it exceeds the largest budget; ``parts_for(i, op, how)``: the fewest parts that fit."""
    splits: dict[str, Split] = {}
    for i, gnode in enumerate(nodes):
        found = over(i)
        op = gnode.node.operation
        if found is None or op.name in splits:
            continue
        need, text = found
        how = _kind(op)
        if how is None:
            raise refuse(op, text, budget_text, need)
        parts = parts_for(i, op, how)
        if parts is None:
            raise PlanError(
                f"layer {op.name!r} alone holds {text}, more than {budget_text}, and split into "
                f"any number of parts its activations and the device overhead are still over "
                f"the budget; raise the budget or lower --max-batch-size"
            )
        size = _size(op, how)
        splits[op.name] = Split(op.name, type(op).__name__, how, size, bounds_for(size, parts))
    return list(splits.values())


def describe(split: Split) -> str:
    unit = "rows" if split.how == "rows" else "output units"
    ranges = ", ".join(f"[{split.bounds[k]}, {split.bounds[k + 1]})" for k in range(split.parts))
    return f"{split.layer} ({split.kind}) split by {split.how} into {split.parts}: {unit} {ranges}"


__all__ = [
    "SPLITTABLE",
    "Split",
    "bounds_for",
    "choose_splits",
    "describe",
    "format_size",
    "parts_needed",
    "refuse",
    "split_model",
]
