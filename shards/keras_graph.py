"""Walking a Keras functional graph: the node that made a tensor, the mask a tensor carries, and
the layer calls in topological order. Read by the partitioner (``shards.partition``) and by the
split of a layer too large for a device (``shards.split``)."""

from __future__ import annotations

from typing import Any

import keras

__all__ = ["mask_of", "owner_node", "topological_nodes"]


def mask_of(tensor: Any) -> Any:
    """The Keras mask a tensor carries, when it is a tensor of the graph (made by an op)."""
    mask = getattr(tensor, "_keras_mask", None)
    if isinstance(mask, keras.KerasTensor) and hasattr(mask, "_keras_history"):
        return mask
    return None


def owner_node(tensor: Any) -> Any:
    op, node_index, _ = tensor._keras_history
    return op._inbound_nodes[node_index]


def topological_nodes(outputs: list[Any]) -> list[Any]:
    """Keras nodes (skipping Input layers) in DFS post-order from the outputs: a topological
    order that keeps each branch together, so fewer tensors cross a cut. A layer that reads its
    input's mask implicitly (attention) comes after the op that makes the mask."""
    order: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(owner_node(t), False) for t in reversed(outputs)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in seen:
            continue
        if expanded:
            seen.add(id(node))
            if not node.is_input:
                order.append(node)
            continue
        stack.append((node, True))
        reads = list(node.input_tensors)
        reads += [m for m in map(mask_of, node.input_tensors) if m is not None]
        for tensor in reversed(reads):
            parent = owner_node(tensor)
            if id(parent) not in seen:
                stack.append((parent, False))
    return order
