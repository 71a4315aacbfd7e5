"""A layer larger than one device, split into the fewest parts that each fit one.

The planner cuts a model between layers; a layer whose weights plus activations at the max
batch exceed the device budget cannot be one stage. It is rewritten instead: the layer's calls
become one call of each part (``shards.partition.split_layers``) and, per call, a combine; the
planner then gives each part a stage of its own (``isolated``), and the combine runs at the
start of the stage that reads the layer's output (or at the driver's last stage). Parts read the
same tensors and not each other's outputs, so the pipeline runs them at the same time.

- ``Embedding`` (``mask_zero`` too), keras_hub's ``ReversibleEmbedding`` and the token table of
  its ``TokenAndPositionEmbedding``: by rows, each part a vocabulary range; the combine adds the
  parts (exact), then, for a TokenAndPositionEmbedding, its positions.
- A tied table's logits (``ReversibleEmbedding(..., reverse=True)``): the same row ranges as
  its lookups, each part the logits of its rows (its columns of the output); the combine
  concatenates (a column slice of a matrix product: 1e-6 relative).
- ``Dense`` and ``EinsumDense``: by output units; the combine concatenates, then activates.

A tied table is split once (one set of row ranges) and held twice: one set of parts does its
lookups at the start of the pipeline, another holds the same rows for its logits at the end.
One actor serving both uses would sit at two places of the pipeline: Ray runs an actor's tasks
in the order they were sent, so batch n+1's lookup would wait for batch n's logits, behind
every stage between them, and the pipeline would hold one batch at a time. The memory plan
counts both sets (each part is a stage with its weights).

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

from shards.bundle.driver_combine import DriverCombine
from shards.errors import PlanError
from shards.partition.flatten import topological_nodes
from shards.partition.memory_plan import format_size, row_bytes
from shards.partition.split_layers import KernelColumns, SplitCombine, TableRows, einsum_letters

SPLITTABLE = (
    "Embedding (mask_zero too), keras_hub's ReversibleEmbedding, Dense and EinsumDense, and "
    "keras_hub's TokenAndPositionEmbedding (its token table) and a ReversibleEmbedding's logits "
    "(reverse=True)"
)
PART_MARK = "_part"
# The use of a tied table's parts that hold its rows again, as logits over the vocabulary.
LOGITS = "logits"


@dataclass(frozen=True)
class Split:
    """One layer split: how (``rows`` or ``columns``), its parts' ranges along that axis."""

    layer: str
    kind: str
    how: str
    size: int  # rows of the table, or output units
    bounds: tuple[int, ...]  # parts' ranges: [bounds[k], bounds[k + 1])
    # A table also called with reverse=True (a tied embedding's logits): a second set of parts
    # holds the same rows for that use.
    reversed: bool = False

    @property
    def parts(self) -> int:
        return len(self.bounds) - 1

    def more(self) -> Split:
        """The same layer in one more part."""
        bounds = bounds_for(self.size, self.parts + 1)
        return Split(self.layer, self.kind, self.how, self.size, bounds, self.reversed)

    def part_name(self, k: int, use: str | None = None) -> str:
        mark = PART_MARK if use is None else f"_{use}{PART_MARK}"
        return f"{self.layer}{mark}{k}of{self.parts}"


def _token_and_position(op: Any) -> bool:
    """keras_hub's TokenAndPositionEmbedding (keras_hub imported only where it is in use)."""
    return any(c.__name__ == "TokenAndPositionEmbedding" for c in type(op).__mro__)


def _table(op: Any) -> Any:
    """The embedding layer whose rows are split: the layer itself, or the token table of a
    TokenAndPositionEmbedding."""
    return op.token_embedding if _token_and_position(op) else op


def _kind(op: Any) -> str | None:
    """``rows``, ``columns`` or None (cannot be split)."""
    if isinstance(op, keras.layers.Embedding) or _token_and_position(op):
        return "rows"
    if isinstance(op, keras.layers.Dense | keras.layers.EinsumDense):
        return "columns"
    return None


def _reversed_call(node: Any) -> bool:
    return bool(node.arguments.kwargs.get("reverse"))


def uses(calls: Sequence[Any], how: str) -> list[tuple[str, list[Any]]]:
    """A split layer's calls by use, each with how its parts divide the output: a table's
    lookups (rows: every part writes the whole output) and its reverse calls (the logits over
    the vocabulary: each part its columns)."""
    found = [(how, [n for n in calls if not _reversed_call(n)])]
    found.append(("columns", [n for n in calls if _reversed_call(n)]))
    return [(h, nodes) for h, nodes in found if nodes]


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
    if isinstance(op, keras.layers.Embedding) or _token_and_position(op):
        return int(_table(op).input_dim)
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


def _reverse_kernel(op: Any) -> np.ndarray:
    """The (output_dim, vocabulary) kernel of a ReversibleEmbedding's logits: the table
    transposed when tied, else its own reverse table."""
    if getattr(op, "tie_weights", True):
        return np.transpose(keras.ops.convert_to_numpy(op.embeddings))
    return keras.ops.convert_to_numpy(op.reverse_embeddings)


def _logit_parts(op: Any, split: Split) -> list[keras.layers.Layer]:
    """The parts of a table's logits: each the columns of its rows (``x @ rows.T``), a Dense
    without a bias as ``KernelColumns`` computes it."""
    if getattr(op, "reverse_dtype", None) is not None:
        raise PlanError(
            f"layer {op.name!r} computes its logits in reverse_dtype={op.reverse_dtype!r}; "
            "splitting such a table is not supported: raise the budget"
        )
    kernel = _reverse_kernel(op)
    layers: list[keras.layers.Layer] = []
    for k in range(split.parts):
        a, b = split.bounds[k], split.bounds[k + 1]
        part = KernelColumns(
            (kernel.shape[0], b - a), None, name=split.part_name(k, LOGITS), dtype=op.dtype_policy
        )
        part.build(None)
        part.kernel.assign(kernel[:, a:b])
        layers.append(part)
    return layers


def _part_layers(op: Any, split: Split) -> list[keras.layers.Layer]:
    """The parts of ``op``, each built and holding its slice of the weights."""
    layers: list[keras.layers.Layer] = []
    for k in range(split.parts):
        a, b = split.bounds[k], split.bounds[k + 1]
        name, policy = split.part_name(k), op.dtype_policy
        part: keras.layers.Layer
        if split.how == "rows":
            table = keras.ops.convert_to_numpy(_table(op).embeddings)
            part = TableRows(a, b - a, table.shape[1], table.shape[0], name=name, dtype=policy)
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
    if _reversed_call(node):
        name = name.replace(op.name, f"{op.name}_{LOGITS}", 1)
        cap = getattr(op, "logit_soft_cap", None)
        return SplitCombine("concat", soft_cap=cap, name=name, dtype=op.dtype_policy)
    if split.how == "rows":
        mask_zero = bool(_table(op).mask_zero)
        return SplitCombine("add", mask_zero=mask_zero, name=name, dtype=op.dtype_policy)
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
    """Topological order with each split layer's calls of one use as one step (its parts serve
    them all: a table's lookups, its logits); stable: otherwise the order the nodes came in.
    ``PlanError`` when one call of a split layer reads what another call of the same use
    makes."""

    def key(n: Any) -> Any:
        if id(n.operation) not in split_ops:
            return id(n)
        return (id(n.operation), _reversed_call(n))

    group = {id(n): key(n) for n in nodes}
    members: dict[Any, list[Any]] = {}
    for n in nodes:
        members.setdefault(group[id(n)], []).append(n)
    first = {g: min(nodes.index(m) for m in ms) for g, ms in members.items()}
    after: dict[Any, set[Any]] = {g: set() for g in members}
    waits: dict[Any, int] = dict.fromkeys(members, 0)
    for n in nodes:
        for t in [*n.input_tensors, *(m for t in n.input_tensors if (m := _mask(t)) is not None)]:
            parent = _owner(t)
            if parent.is_input or id(parent) not in group:
                continue
            a, b = group[id(parent)], group[id(n)]
            if a == b:
                raise PlanError(
                    f"layer {n.operation.name!r} is called on its own output; splitting it is "
                    "not supported: raise the budget"
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
            "a split layer's calls depend on each other's outputs; splitting it is not "
            "supported: raise the budget"
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
        logits = _reversed_call(step[0])
        parts = _logit_parts(op, split) if logits else _part_layers(op, split)
        outs = [keras.tree.flatten(part(reads)) for part in parts]
        for c, node in enumerate(step):
            _plain_call(node)
            combine = _combine(op, split, node, c)
            pieces = [o[c] for o in outs]
            if _token_and_position(op):
                pieces.append(_positions(op, pieces[0], c))
                combine.extra = 1
            joined = combine([reads[c], *pieces] if combine.mask_zero else pieces)
            values[id(node.outputs[0])] = joined
    return keras.Model(inputs, [values[id(t)] for t in model.outputs], name=model.name)


def hand_to_driver(model: keras.Model) -> tuple[keras.Model, dict[int, DriverCombine]]:
    """``model`` (split) with each output that is a combine nothing else reads, and that numpy
    computes as Keras does (a concatenation, with a soft cap or no activation; a sum), replaced
    by the parts it joins; by output index, the combine the driver does instead
    (``shards.bundle.driver_combine``; its output's name is the caller's to fill, its parts
    named after the part layers)."""
    outputs: list[Any] = []
    handed: dict[int, DriverCombine] = {}
    for i, tensor in enumerate(model.outputs):
        op, index, _ = tensor._keras_history
        linear = getattr(op, "activation", None) is keras.activations.linear
        if (
            not isinstance(op, SplitCombine)
            or op._outbound_nodes
            or (op.how == "concat" and not linear)
            or (op.how == "add" and op.extra)
        ):
            outputs.append(tensor)
            continue
        node = op._inbound_nodes[index]
        parts = list(node.input_tensors)[1 if op.mask_zero else 0 :]
        names = tuple(t._keras_history[0].name for t in parts)
        handed[i] = DriverCombine("", op.how, names, op.axis, op.soft_cap)
        outputs.extend(parts)
    if not handed:
        return model, {}
    return keras.Model(model.inputs, outputs, name=model.name), handed


def _plain_call(node: Any) -> None:
    """A call the parts reproduce: one tensor in; no start_index or positions (a cache's
    decoding step), which the parts do not take."""
    extra = set(node.arguments.kwargs) - {"reverse", "training", "mask"}
    if len(node.arguments.args) != 1 or extra:
        raise PlanError(
            f"layer {node.operation.name!r} is called with {sorted(extra) or 'several inputs'}; "
            "a split layer's parts take its input alone: raise the budget"
        )


def _positions(op: Any, like: Any, call: int) -> Any:
    """A TokenAndPositionEmbedding's positions for its split token lookup (a copy of its small
    position table, read for the shape of a part's output), which the combine adds to the
    parts' sum as the layer's call adds them to its lookup."""
    source = op.position_embedding
    suffix = "" if call == 0 else f"_call{call + 1}"
    config = source.get_config() | {"name": f"{op.name}_positions{suffix}"}
    positions = type(source).from_config(config)
    positions.build(tuple(like.shape))
    positions.set_weights(source.get_weights())
    return positions(like)


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
        tied = any(g.node.operation is op and _reversed_call(g.node) for g in nodes)
        splits[op.name] = Split(
            op.name, type(op).__name__, how, size, bounds_for(size, parts), tied
        )
    return list(splits.values())


def describe(split: Split) -> str:
    unit = "rows" if split.how == "rows" else "output units"
    ranges = ", ".join(f"[{split.bounds[k]}, {split.bounds[k + 1]})" for k in range(split.parts))
    held = ", its rows held again for its logits" if split.reversed else ""
    text = f"{split.layer} ({split.kind}) split by {split.how} into {split.parts}: {unit} {ranges}"
    return text + held


__all__ = [
    "LOGITS",
    "SPLITTABLE",
    "Split",
    "bounds_for",
    "choose_splits",
    "describe",
    "format_size",
    "hand_to_driver",
    "parts_needed",
    "refuse",
    "split_model",
    "uses",
]
