"""A Keras model's layer graph as a list of nodes in topological order, and the sub-model over a
contiguous range of them.

Nodes are layer calls, so a layer called twice is two nodes. A stage's inputs are the tensors
produced before its range (or model inputs) and consumed in it; its outputs are the tensors
produced in it that later stages consume or that are model outputs. A tensor that a later stage
needs but this stage does not produce is never routed through it (Keras cannot output a tensor a
sub-model merely hands on): the driver routes every tensor by name from wherever it was produced.

Nested functional and Sequential models are flattened into their layers first
(``shards.partition.flatten``). A layer called in several places is charged its weights at every
call, so
each stage that calls it counts them. An implicit Keras mask (``Embedding(mask_zero=True)``) is
a tensor of the graph: it crosses a cut like any other, and the next stage attaches it again to
the tensor it belongs to (``shards.bundle.masking.CarryMask``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import keras

from shards.bundle.format import StageSpec
from shards.bundle.masking import CarryMask
from shards.errors import PartitionError
from shards.keras_graph import topological_nodes
from shards.partition.flatten import flatten_nested, runtime_masks
from shards.partition.length_bound import (
    LengthBound,
    bound_signature,
    declared_bounds,
    probe_bound,
    tightest,
)
from shards.partition.length_masks import mark_masked_inputs
from shards.partition.memory_plan import DEFAULT_MAX_SEQUENCE_LENGTH
from shards.partition.plan import NodeCost, estimate_flops, param_bytes
from shards.signature import ModelSignature, TensorSpec


@dataclass(frozen=True)
class GraphNode:
    name: str
    node: Any  # the Keras Node: the call to replay when the stage is built
    inputs: tuple[Any, ...]  # KerasTensors, deduplicated, in call order
    outputs: tuple[Any, ...]
    cost: NodeCost


@dataclass(frozen=True)
class Graph:
    model: keras.Model
    nodes: tuple[GraphNode, ...]
    tensor_names: dict[int, str]  # id(KerasTensor) -> bundle-wide name
    input_ids: tuple[int, ...]  # model inputs, in the model's order
    output_ids: tuple[int, ...]
    signature: ModelSignature
    # Per node: id(input tensor) -> the Keras mask (a tensor of the graph) it carries when the
    # node runs, for masked inputs only.
    masks: tuple[dict[int, Any], ...] = field(default_factory=tuple)
    # What a dimension unknown in the graph was costed at: the length asked for, else the
    # model's own bound (shards.partition.length_bound), else DEFAULT_MAX_SEQUENCE_LENGTH.
    sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH


def _spec(tensor: Any, name: str) -> TensorSpec:
    return TensorSpec(name=name, shape=tuple(tensor.shape[1:]), dtype=str(tensor.dtype))


def _named(struct: Any, flat: Sequence[Any], fallback: Sequence[str]) -> list[str]:
    """Names of a model's flat inputs/outputs: dict keys when the model was built with a dict,
    joined by dots through nested structures (``{"a": {"b": t}}`` names ``t`` ``a.b``)."""
    if not _has_dict(struct):
        return list(fallback)
    by_id: dict[int, str] = {}
    for path, tensor in keras.tree.flatten_with_path(struct):
        by_id.setdefault(id(tensor), ".".join(str(p) for p in path))
    return [by_id[id(t)] for t in flat]


def _has_dict(struct: Any) -> bool:
    if isinstance(struct, dict):
        return True
    return isinstance(struct, list | tuple) and any(_has_dict(s) for s in struct)


def _unique(name: str, taken: set[str]) -> str:
    candidate, k = name, 1
    while candidate in taken:
        candidate, k = f"{name}_{k}", k + 1
    taken.add(candidate)
    return candidate


def as_functional(model: keras.Model) -> keras.Model:
    if isinstance(model, keras.Sequential):
        try:
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError) as exc:
            raise PartitionError(
                f"Sequential model {model.name!r} has no known input shape; start it with "
                "keras.Input(shape=...) so it can be cut"
            ) from exc
        return keras.Model(inputs=inputs, outputs=outputs, name=model.name)
    if not hasattr(model, "_inputs_struct"):
        raise PartitionError(
            f"model {model.name!r} is a subclassed {type(model).__name__}; only Sequential and "
            "functional models have a layer graph to cut"
        )
    return model


def analyse(model: keras.Model, sequence_length: int | None = None) -> Graph:
    """``model``'s layer calls, costed with a dimension unknown in the graph at
    ``sequence_length`` (``--max-sequence-length``); ``None``: at the model's own bound, else
    at ``DEFAULT_MAX_SEQUENCE_LENGTH``. ``PartitionError`` for a length over the bound."""
    model = as_functional(model)
    input_names = _named(model._inputs_struct, model.inputs, [t.name for t in model.inputs])
    output_names = _named(model._outputs_struct, model.outputs, model.output_names)
    # Named from the model as the user built it; flattening keeps the order of the flat lists.
    model = flatten_nested(model)
    order = topological_nodes(model.outputs)
    bounds = _length_bounds(model, order, sequence_length)
    length = planned_length(sequence_length, tightest(bounds))
    graph = _layer_graph(model, input_names, output_names, length)
    signature = ModelSignature(
        name=model.name,
        inputs=tuple(_spec(t, graph.tensor_names[id(t)]) for t in model.inputs),
        outputs=tuple(_spec(t, graph.tensor_names[id(t)]) for t in model.outputs),
    )
    signature = mark_masked_inputs(signature, model.inputs, order)
    signature = bound_signature(signature, bounds)
    return replace(graph, signature=signature)


def reanalyse(graph: Graph, model: keras.Model, output_names: Sequence[str] | None = None) -> Graph:
    """The graph of ``model``, a rewrite of ``graph.model`` with the same inputs and outputs in
    the same order (a layer split into parts: ``shards.split``): named, bounded and
    signed as ``graph``. ``output_names``: the names of ``model``'s outputs where they are not
    the signature's (a split output's parts, which the driver joins)."""
    names = [t.name for t in graph.signature.outputs] if output_names is None else output_names
    return replace(
        _layer_graph(model, [t.name for t in graph.signature.inputs], names, graph.sequence_length),
        signature=graph.signature,
    )


def _layer_graph(
    model: keras.Model, input_names: Sequence[str], output_names: Sequence[str], length: int
) -> Graph:
    """A flat functional model's live layer calls, costed at ``length``; its signature bare
    (the caller's to fill)."""
    taken: set[str] = set()
    names: dict[int, str] = {}
    for tensor, name in zip(model.inputs, input_names, strict=True):
        names[id(tensor)] = _unique(name, taken)
    for tensor, name in zip(model.outputs, output_names, strict=True):
        if id(tensor) in names:
            raise PartitionError(
                f"model output {name!r} is the model input {names[id(tensor)]!r} itself or "
                "another output; serve a model whose outputs are computed by layers"
            )
        names[id(tensor)] = _unique(name, taken)

    nodes: list[GraphNode] = []
    calls: dict[int, int] = {}
    order = topological_nodes(model.outputs)
    for node in order:
        op = node.operation
        calls[id(op)] = calls.get(id(op), 0) + 1
        outputs = tuple(node.output_tensors)
        for k, tensor in enumerate(outputs):
            if id(tensor) not in names:
                suffix = "" if calls[id(op)] == 1 else f"_call{calls[id(op)]}"
                suffix += "" if len(outputs) == 1 else f"_out{k}"
                names[id(tensor)] = _unique(f"{op.name}{suffix}", taken)
        inputs = tuple({id(t): t for t in node.input_tensors}.values())
        # A reused layer's weights are charged at every call: any stage that calls it holds
        # them (two calls in one stage over-count, never under-count).
        flops = estimate_flops(op, inputs, outputs, length)
        cost = NodeCost(op.name, param_bytes(op), flops)
        nodes.append(GraphNode(op.name, node, inputs, outputs, cost))

    masks = runtime_masks(order)
    # A mask op reached through a mask that no layer reads when the model runs is dead.
    live = {id(t) for t in model.outputs}
    keep: list[int] = []
    for i in reversed(range(len(nodes))):
        if any(id(t) in live for t in nodes[i].outputs):
            keep.insert(0, i)
            live.update(id(t) for t in nodes[i].inputs)
            live.update(id(m) for m in masks[i].values())
    return Graph(
        model=model,
        nodes=tuple(nodes[i] for i in keep),
        tensor_names=names,
        input_ids=tuple(id(t) for t in model.inputs),
        output_ids=tuple(id(t) for t in model.outputs),
        signature=ModelSignature(name=model.name, inputs=(), outputs=()),
        masks=tuple(masks[i] for i in keep),
        sequence_length=length,
    )


def _length_bounds(
    model: keras.Model, order: list[Any], requested: int | None
) -> list[LengthBound]:
    """What the layers declare; where none does, what a probe of the model finds up to the
    length asked for (else the default)."""
    bounds = declared_bounds(model.inputs, order)
    if bounds:
        return bounds
    probed = probe_bound(model, model.inputs, requested or DEFAULT_MAX_SEQUENCE_LENGTH)
    return [] if probed is None else [probed]


def planned_length(requested: int | None, bound: LengthBound | None) -> int:
    """The length to plan at: ``requested`` where given and within the bound, else the bound,
    else the default; ``PartitionError`` naming both numbers for one over the bound."""
    if bound is None:
        return DEFAULT_MAX_SEQUENCE_LENGTH if requested is None else requested
    if requested is None:
        return bound.length
    if requested > bound.length:
        raise PartitionError(
            f"max_sequence_length={requested} is over {bound.length}, the longest input this "
            f"model takes ({bound.source}); serve it with --max-sequence-length at most "
            f"{bound.length}, or leave the flag out to serve up to {bound.length}"
        )
    return requested


def _named_once(op: Any, owners: dict[str, int], taken: set[str], copies: dict[int, Any]) -> Any:
    """``op``, or where another operation of the stage already has its name, a renamed copy.

    A model loaded from a ``.keras`` file can hold two mask ops of one name: the saved one
    keeps its name, and the Embedding called again while loading makes its own under the same
    auto name (Keras's counters start empty in a fresh process). A stage needs unique names."""
    if id(op) in copies:
        return copies[id(op)]
    if owners.setdefault(op.name, id(op)) == id(op):
        return op
    if isinstance(op, keras.layers.Layer):
        raise PartitionError(
            f"two layers of the model are both named {op.name!r}; give them distinct names"
        )
    # A plain operation (not_equal, ...) holds no weights: a shallow copy computes the same.
    renamed = copy.copy(op)
    renamed.name = _unique(op.name, taken)
    renamed._inbound_nodes, renamed._outbound_nodes = [], []
    owners[renamed.name] = id(renamed)
    copies[id(op)] = renamed
    return renamed


def _replay(
    graph: Graph,
    start: int,
    end: int,
    ins: list[Any],
    outs: list[Any],
    name: str,
    carried: dict[int, Any],
) -> keras.Model:
    """Call the range's layers again on fresh ``keras.Input``s. Not ``keras.Model(inputs=
    <intermediate tensors>)``: its graph cloning swaps every call of the layer that produced an
    intermediate input for the new Input, which breaks a reused layer called inside the stage."""
    mapping: dict[int, Any] = {}
    # Input layers share the stage's namespace of operation names (the bundle's tensor names
    # are often layer names).
    taken = {n.node.operation.name for n in graph.nodes[start:end]}
    for tensor in ins:
        input_name = _unique(graph.tensor_names[id(tensor)], taken)
        mapping[id(tensor)] = keras.Input(
            batch_shape=tensor.shape, dtype=tensor.dtype, name=input_name
        )
    new_ins = [mapping[id(t)] for t in ins]
    owners: dict[str, int] = {}
    copies: dict[int, Any] = {}
    # Stage inputs whose mask arrived as a tensor of its own: attached before the first read.
    unmasked = set(carried)

    def substitute(value: Any) -> Any:
        return mapping[id(value)] if isinstance(value, keras.KerasTensor) else value

    for gnode in graph.nodes[start:end]:
        for tensor in gnode.inputs:
            if id(tensor) in unmasked:
                unmasked.discard(id(tensor))
                carry = CarryMask(name=_unique(f"{graph.tensor_names[id(tensor)]}_mask", taken))
                mask = mapping[id(carried[id(tensor)])]
                mapping[id(tensor)] = carry(mapping[id(tensor)], mask=mask)
        args = keras.tree.map_structure(substitute, gnode.node.arguments.args)
        kwargs = keras.tree.map_structure(substitute, gnode.node.arguments.kwargs)
        op = _named_once(gnode.node.operation, owners, taken, copies)
        result = op(*args, **kwargs)
        for old, new in zip(gnode.outputs, keras.tree.flatten(result), strict=True):
            mapping[id(old)] = new
    new_outs = [mapping[id(t)] for t in outs]
    return keras.Model(
        inputs=new_ins[0] if len(new_ins) == 1 else new_ins,
        outputs=new_outs[0] if len(new_outs) == 1 else new_outs,
        name=name,
    )


def cut(graph: Graph, start: int, end: int, index: int) -> tuple[keras.Model, StageSpec]:
    """The sub-model over nodes[start:end] and its spec (file named after the index)."""
    produced: set[int] = set()
    inputs: dict[int, Any] = {}
    carried: dict[int, Any] = {}  # stage input -> the mask it carries at its first read here
    for node, masks in zip(graph.nodes[start:end], graph.masks[start:end], strict=True):
        for tensor in node.inputs:
            if id(tensor) not in produced and id(tensor) not in inputs:
                inputs[id(tensor)] = tensor
                if id(tensor) in masks:
                    carried[id(tensor)] = masks[id(tensor)]
        produced.update(id(t) for t in node.outputs)
    # A mask made before the stage travels with the masked tensors the stage receives.
    for mask in carried.values():
        if id(mask) not in produced:
            inputs.setdefault(id(mask), mask)
    needed_later = {id(t) for node in graph.nodes[end:] for t in node.inputs}
    needed_later.update(id(m) for masks in graph.masks[end:] for m in masks.values())
    needed_later.update(graph.output_ids)
    outputs = [t for node in graph.nodes[start:end] for t in node.outputs if id(t) in needed_later]
    ins, outs = list(inputs.values()), outputs
    stage = _replay(graph, start, end, ins, outs, f"stage_{index:03d}", carried)
    names = graph.tensor_names
    spec = StageSpec(
        index=index,
        file=f"stage_{index:03d}.keras",
        inputs=tuple(_spec(t, names[id(t)]) for t in ins),
        outputs=tuple(_spec(t, names[id(t)]) for t in outs),
        param_bytes=param_bytes(stage),
        flops_per_row=sum(n.cost.flops_per_row for n in graph.nodes[start:end]),
    )
    return stage, spec
