"""A functional model's layer calls in topological order, and the same model with every nested
functional or Sequential model replaced by its own layers, so that each inner layer is a node
the partitioner can cut at.

Flattening calls the layers again on fresh ``keras.Input``s: an inner model's inputs stand for
the outer tensors it was called on, its layers are called on those (a model called twice calls
its layers twice, sharing their weights), and its outputs are the tensors the outer graph reads.
Implicit Keras masks (``Embedding(mask_zero=True)``) are recomputed on the way, as Keras computes
them when the whole model runs.
"""

from __future__ import annotations

from typing import Any

import keras
from keras.src.models.functional import Functional

from shards.errors import PartitionError
from shards.keras_graph import mask_of, topological_nodes


def runtime_masks(nodes: list[Any]) -> list[dict[int, Any]]:
    """For each node (in run order), the masks its inputs carry when it runs: id(tensor) ->
    mask. Not simply each tensor's ``_keras_mask``: when the model runs, MultiHeadAttention
    deletes the masks of its query, value and key, so a layer that runs after it gets none, and
    a layer whose first input lost its mask makes no mask either (``Add([x, attention(x)])``)."""
    erased: set[int] = set()
    seen: list[dict[int, Any]] = []
    for node in nodes:
        reads = {id(t): m for t in node.input_tensors if (m := mask_of(t)) is not None}
        seen.append({k: m for k, m in reads.items() if k not in erased})
        first = keras.tree.flatten(node.arguments.args[:1])
        explicit = node.arguments.kwargs.get("mask") is not None
        if not explicit and any(id(t) in erased and id(t) in reads for t in first):
            erased.update(id(t) for t in node.outputs)
        if isinstance(node.operation, keras.layers.MultiHeadAttention):
            kwargs = node.arguments.kwargs
            qvk = [*node.arguments.args[:3], *(kwargs.get(k) for k in ("query", "value", "key"))]
            erased.update(id(t) for t in qvk if isinstance(t, keras.KerasTensor))
    return seen


def _inner_graph(op: Any) -> Any:
    """The functional graph of a nested model, or None for a layer (or a subclassed model,
    which stays one node: its ``call`` is Python, not a graph)."""
    if isinstance(op, keras.Sequential):
        return getattr(op, "_functional", None)
    if isinstance(op, Functional) and type(op).call is Functional.call:
        return op
    return None


def has_nested_models(model: keras.Model) -> bool:
    return any(_inner_graph(n.operation) is not None for n in topological_nodes(model.outputs))


def _inner_inputs(inner: Any, given: Any) -> list[Any]:
    """The tensors a nested model's call binds to its flat inputs, as ``Functional.call`` binds
    them: a dict to a list by names, a dtype cast, a rank off by one squeezed or expanded (ops
    only where they change something: Keras's own conversion adds a node per input)."""
    if isinstance(given, dict) and not isinstance(inner._inputs_struct, dict):
        flat = [given[t.name] for t in inner.inputs]
    else:
        flat = keras.tree.flatten(given)
    cast = [
        x if x.dtype == ref.dtype else keras.ops.cast(x, ref.dtype)
        for x, ref in zip(flat, inner.inputs, strict=True)
    ]
    return list(inner._adjust_input_rank(cast))


def _replay_into(model: Any, values: dict[int, Any]) -> None:
    """Call ``model``'s layers on the tensors in ``values`` (keyed by the id of the tensor they
    stand for), recursing into nested models; every tensor made is added to ``values``."""

    def substitute(value: Any) -> Any:
        return values[id(value)] if isinstance(value, keras.KerasTensor) else value

    for node in topological_nodes(model.outputs):
        op = node.operation
        args = keras.tree.map_structure(substitute, node.arguments.args)
        kwargs = keras.tree.map_structure(substitute, node.arguments.kwargs)
        inner = _inner_graph(op)
        if inner is None:
            made = keras.tree.flatten(op(*args, **kwargs))
        else:
            flat = _inner_inputs(inner, args[0] if args else kwargs["inputs"])
            values.update({id(old): new for old, new in zip(inner.inputs, flat, strict=True)})
            _replay_into(inner, values)
            made = [values[id(t)] for t in inner.outputs]
        for old, new in zip(node.outputs, made, strict=True):
            values[id(old)] = new


def flatten_nested(model: keras.Model) -> keras.Model:
    """``model`` itself when it nests no model; else a model over the same layers with the
    nested models' layers called directly, inputs and outputs flat and in the same order."""
    if not has_nested_models(model):
        return model
    values: dict[int, Any] = {}
    inputs = []
    for tensor in model.inputs:
        new = keras.Input(batch_shape=tensor.shape, dtype=tensor.dtype, name=tensor.name)
        values[id(tensor)] = new
        inputs.append(new)
    _replay_into(model, values)
    try:
        return keras.Model(inputs, [values[id(t)] for t in model.outputs], name=model.name)
    except ValueError as exc:
        if "should be unique" not in str(exc):
            raise
        raise PartitionError(
            f"model {model.name!r} nests models whose layers share a name ({exc}); give the "
            "nested models' layers distinct names to cut it"
        ) from None
