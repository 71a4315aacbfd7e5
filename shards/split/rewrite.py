"""A model with its split layers rewritten: each layer's calls become one call of each part
(``shards.split.layers``) and, per call, a combine; a combine that is a model output and that
numpy computes as Keras does is handed to the driver (``shards.split.combine``).

Parts read the same tensors and not each other's outputs, so the pipeline runs them at the same
time.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import keras

from shards.errors import PlanError
from shards.keras_graph import mask_of, owner_node, topological_nodes
from shards.split.combine import DriverCombine
from shards.split.layers import (
    KernelColumns,
    PairedSlices,
    SplitCombine,
    TableRows,
    einsum_letters,
)
from shards.split.lookup import DEFAULT_LOOKUP_COMBINE, check_lookup_combine
from shards.split.rule import (
    LOGITS,
    Split,
    reversed_call,
    routes,
    table_of,
    token_and_position,
    units_axis,
)
from shards.split.views import SliceOf, build_viewing

__all__ = ["hand_to_driver", "split_model"]


def _logit_parts(op: Any, split: Split) -> list[keras.layers.Layer]:
    """The parts of a table's logits: each the columns of its rows (``x @ rows.T``: the table's
    rows read transposed when tied, else the columns of its own reverse table), a Dense without
    a bias as ``KernelColumns`` computes it."""
    if getattr(op, "reverse_dtype", None) is not None:
        raise PlanError(
            f"layer {op.name!r} computes its logits in reverse_dtype={op.reverse_dtype!r}; "
            "splitting such a table is not supported: raise the budget"
        )
    tied = getattr(op, "tie_weights", True)
    dim = int(op.embeddings.shape[1])
    layers: list[keras.layers.Layer] = []
    for k in range(split.parts):
        a, b = split.bounds[k], split.bounds[k + 1]
        # Tied: the table's rows as they are, read transposed (``x @ rows.T``, as the table
        # computes its logits), so an actor holding the lookup's rows can serve both uses.
        if tied:
            kernel, shape = SliceOf(op.embeddings, 0, a, b), (b - a, dim)
        else:
            kernel, shape = SliceOf(op.reverse_embeddings, 1, a, b), (dim, b - a)
        part = KernelColumns(
            shape,
            None,
            transposed=tied,
            name=split.part_name(k, LOGITS),
            dtype=op.dtype_policy,
        )
        build_viewing(part, {"kernel": kernel})
        layers.append(part)
    return layers


def _part_layers(op: Any, split: Split, routed: bool = False) -> list[keras.layers.Layer]:
    """The parts of ``op``, each built with its weights views of its slice of ``op``'s
    (``shards.split.views``: read when its stage is written, not held)."""
    layers: list[keras.layers.Layer] = []
    for k in range(split.parts):
        a, b = split.bounds[k], split.bounds[k + 1]
        name, policy = split.part_name(k), op.dtype_policy
        part: keras.layers.Layer
        if split.how == "rows":
            table = table_of(op).embeddings
            vocabulary, dim = (int(d) for d in table.shape)
            part = TableRows(a, b - a, dim, vocabulary, routed, name=name, dtype=policy)
            build_viewing(part, {"embeddings": SliceOf(table, 0, a, b)})
            layers.append(part)
            continue
        if isinstance(op, keras.layers.Dense):
            equation, axis = None, 1
            bias = None if op.bias is None else SliceOf(op.bias, 0, a, b)
        else:
            equation = op.equation
            _, axis, _ = units_axis(op)
            bias = None if op.bias is None else _bias_slice(op, a, b)
        kernel_shape = [int(d) for d in op.kernel.shape]
        kernel_shape[axis] = b - a
        part = KernelColumns(
            kernel_shape,
            None if bias is None else _shape_of(bias),
            equation,
            name=name,
            dtype=policy,
        )
        sources = {"kernel": SliceOf(op.kernel, axis, a, b)}
        build_viewing(part, sources if bias is None else sources | {"bias": bias})
        layers.append(part)
    return layers


def _paired_parts(first: Any, second: Any, split: Split) -> list[keras.layers.Layer]:
    """The parts of a pair: part k the first layer's output units ``[a, b)`` (its kernel's
    columns and bias), the activations between, and the second layer's input units ``[a, b)``
    (its kernel's rows); the second layer's bias held by part 0 alone, so the sum adds it once."""
    layers: list[keras.layers.Layer] = []
    for k in range(split.parts):
        a, b = split.bounds[k], split.bounds[k + 1]
        with_bias_out = k == 0 and second.bias is not None
        part = PairedSlices(
            (int(first.kernel.shape[0]), b - a),
            first.bias is not None,
            (b - a, int(second.kernel.shape[1])),
            with_bias_out,
            split.steps,
            name=split.part_name(k),
            dtype=first.dtype_policy,
        )
        sources = {
            "kernel_in": SliceOf(first.kernel, 1, a, b),
            "kernel_out": SliceOf(second.kernel, 0, a, b),
        }
        if part.has_bias_in:
            sources["bias_in"] = SliceOf(first.bias, 0, a, b)
        if with_bias_out:
            sources["bias_out"] = SliceOf(second.bias)
        build_viewing(part, sources)
        layers.append(part)
    return layers


def _shape_of(view: SliceOf) -> tuple[int, ...]:
    shape = [int(d) for d in view.source.shape]
    if view.axis is not None:
        shape[view.axis] = view.stop - view.start
    return tuple(shape)


def _bias_slice(op: Any, a: int, b: int) -> SliceOf:
    """An EinsumDense bias is broadcast against the output from the right: slice it on the
    units axis where it has one."""
    letter, _, size = units_axis(op)
    bias_rank = len(op.bias.shape)
    out_rank = len(op.output.shape) if hasattr(op, "output") else bias_rank
    ranks = [out_rank, len(op.kernel.shape)]
    _, out = einsum_letters(op.equation, ranks)
    axis = out.index(letter) - (len(out) - bias_rank)
    if axis < 0 or int(op.bias.shape[axis]) != size:
        return SliceOf(op.bias)
    return SliceOf(op.bias, axis, a, b)


def _combine(op: Any, split: Split, node: Any, call: int, routed: bool) -> SplitCombine:
    # Named as the layer was, so a model output keeps its name; a second call's combine after it.
    name = op.name if call == 0 else f"{op.name}_call{call + 1}"
    if reversed_call(node):
        name = name.replace(op.name, f"{op.name}_{LOGITS}", 1)
        cap = getattr(op, "logit_soft_cap", None)
        return SplitCombine("concat", soft_cap=cap, name=name, dtype=op.dtype_policy)
    if split.how == "rows":
        mask_zero = bool(table_of(op).mask_zero)
        how = "scatter" if routed else "add"
        return SplitCombine(how, mask_zero=mask_zero, name=name, dtype=op.dtype_policy)
    axis = -1
    if isinstance(op, keras.layers.EinsumDense):
        letter, _, _ = units_axis(op)
        ranks = [len(node.input_tensors[0].shape), len(op.kernel.shape)]
        _, out = einsum_letters(op.equation, ranks)
        axis = out.index(letter) - len(out)
    return SplitCombine(
        "concat", axis=axis, activation=op.activation, name=name, dtype=op.dtype_policy
    )


def _order(nodes: list[Any], split_ops: set[int]) -> list[list[Any]]:
    """Topological order with each split layer's calls of one use as one step (its parts serve
    them all: a table's lookups, its logits); stable: otherwise the order the nodes came in.
    ``PlanError`` when one call of a split layer reads what another call of the same use
    makes."""

    def key(n: Any) -> Any:
        if id(n.operation) not in split_ops:
            return id(n)
        return (id(n.operation), reversed_call(n))

    group = {id(n): key(n) for n in nodes}
    members: dict[Any, list[Any]] = {}
    for n in nodes:
        members.setdefault(group[id(n)], []).append(n)
    first = {g: min(nodes.index(m) for m in ms) for g, ms in members.items()}
    after: dict[Any, set[Any]] = {g: set() for g in members}
    waits: dict[Any, int] = dict.fromkeys(members, 0)
    for n in nodes:
        for t in [*n.input_tensors, *(m for t in n.input_tensors if (m := mask_of(t)) is not None)]:
            parent = owner_node(t)
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


def split_model(
    model: keras.Model, splits: Sequence[Split], lookup_combine: str = DEFAULT_LOOKUP_COMBINE
) -> keras.Model:
    """``model`` with each layer of ``splits`` replaced by its parts and a combine per call.

    ``lookup_combine`` (``shards.split.lookup``): how a table split by rows is joined:
    ``routed`` (each part writes only its rows' vectors and their positions; the combine
    scatters them) or ``dense`` (each part writes the whole output, zeros outside its rows; the
    combine adds). The dense combine stays where routing cannot apply (``routes``): a lookup
    whose output is a model output (the driver joins it, with numpy's add), a
    TokenAndPositionEmbedding's token table (its positions read the lookup's shape) and a tied
    table's logits (split by columns)."""
    check_lookup_combine(lookup_combine)
    by_name = {s.layer: s for s in splits}
    nodes = topological_nodes(model.outputs)
    split_ops = {id(n.operation) for n in nodes if n.operation.name in by_name}
    # A pair's second layer and the layers between: their calls are the pair's parts.
    absorbed = {name for s in splits if s.pair is not None for name in (*s.between, s.pair)}
    node_of = {n.operation.name: n for n in nodes}
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
        if op.name in absorbed:
            continue
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
        if split.pair is not None:
            (node,) = step
            _plain_call(node)
            second = node_of[split.pair]
            pieces = [
                keras.tree.flatten(part(reads))[0]
                for part in _paired_parts(op, second.operation, split)
            ]
            # The partial products summed, then the second layer's activation.
            combine = SplitCombine(
                "add",
                activation=second.operation.activation,
                name=second.operation.name,
                dtype=second.operation.dtype_policy,
            )
            values[id(second.outputs[0])] = combine(pieces)
            continue
        logits = reversed_call(step[0])
        routed = routes(op, split.how, step, model.outputs, lookup_combine)
        parts = _logit_parts(op, split) if logits else _part_layers(op, split, routed)
        outs = [keras.tree.flatten(part(reads)) for part in parts]
        for c, node in enumerate(step):
            _plain_call(node)
            combine = _combine(op, split, node, c, routed)
            if routed:
                # Each part's vectors and their positions, part after part.
                pieces = [o[i] for o in outs for i in (2 * c, 2 * c + 1)]
            else:
                pieces = [o[c] for o in outs]
            if token_and_position(op):
                pieces.append(_positions(op, pieces[0], c))
                combine.extra = 1
            first = combine.mask_zero or combine.how == "scatter"
            joined = combine([reads[c], *pieces] if first else pieces)
            values[id(node.outputs[0])] = joined
    return keras.Model(inputs, [values[id(t)] for t in model.outputs], name=model.name)


def hand_to_driver(model: keras.Model) -> tuple[keras.Model, dict[int, DriverCombine]]:
    """``model`` (split) with each output that is a combine nothing else reads, and that numpy
    computes as Keras does (a concatenation, with a soft cap or no activation; a sum), replaced
    by the parts it joins; by output index, the combine the driver does instead
    (``shards.split``; its output's name is the caller's to fill, its parts
    named after the part layers)."""
    outputs: list[Any] = []
    handed: dict[int, DriverCombine] = {}
    for i, tensor in enumerate(model.outputs):
        op, index, _ = tensor._keras_history
        linear = getattr(op, "activation", None) is keras.activations.linear
        if (
            not isinstance(op, SplitCombine)
            or op._outbound_nodes
            or not linear
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
