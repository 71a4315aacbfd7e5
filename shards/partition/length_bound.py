"""The longest input a model takes along its unknown dimension (a sequence length), where the
graph bounds it: ``TensorSpec.max_length``, found when the model is cut.

A position embedding has one row per position, so a longer input fails inside it (``Expected
size[0] in [0, 32], but got 512``). The bound is read from the graph where a layer says it:

- keras_hub's ``PositionEmbedding`` and ``TokenAndPositionEmbedding``: their ``sequence_length``;
- any layer whose config has ``sequence_length``, ``max_sequence_length`` or ``maxlen`` equal to
  the first dimension of one of its weights (one row per position).

Such a bound applies to the model inputs the layer reads through the graph. Where no layer says,
the model is run on one row at growing lengths up to the probe's ceiling (the length asked for,
else 512): a length that fails after a shorter one ran bounds every input of unknown length at
the longest that runs; where every length runs, nothing bounds it. The partitioner then plans at
the bound (the memory plan, the stages' warm-up), and the server serves up to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import keras
import numpy as np

from shards.signature import ModelSignature

NAMED_LAYERS = ("PositionEmbedding", "TokenAndPositionEmbedding")
LENGTH_KEYS = ("sequence_length", "max_sequence_length", "maxlen")


@dataclass(frozen=True)
class LengthBound:
    """``length``: the longest that runs; ``inputs``: positions in the model's inputs it
    bounds; ``source``: where it was found, for messages."""

    length: int
    inputs: frozenset[int]
    source: str


def _declared_length(op: Any) -> int | None:
    try:
        config = op.get_config()
    except Exception:  # a layer without a config declares nothing
        return None
    if not isinstance(config, dict):
        return None
    if type(op).__name__ in NAMED_LAYERS:
        value = config.get("sequence_length")
        return value if _is_length(value) else None
    firsts = {int(w.shape[0]) for w in getattr(op, "weights", ()) if len(w.shape) >= 1}
    for key in LENGTH_KEYS:
        value = config.get(key)
        if _is_length(value) and value in firsts:
            return int(value)
    return None


def _is_length(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def declared_bounds(inputs: Sequence[Any], nodes: Sequence[Any]) -> list[LengthBound]:
    """The bounds the layers of ``nodes`` (Keras nodes, run order) declare, each over the model
    ``inputs`` (KerasTensors, in the signature's order) it reads through the graph."""
    # Only inputs of unknown length: a fixed one is as long as it is.
    position = {id(t): i for i, t in enumerate(inputs) if None in tuple(t.shape[1:])}
    producer = {id(t): node for node in nodes for t in node.output_tensors}
    bounds = []
    for node in nodes:
        length = _declared_length(node.operation)
        if length is None:
            continue
        reached = _inputs_read(node, producer, position)
        if reached:
            op = node.operation
            source = f"layer {op.name!r} ({type(op).__name__}) has {length} positions"
            bounds.append(LengthBound(length, frozenset(reached), source))
    return bounds


def _inputs_read(node: Any, producer: dict[int, Any], position: dict[int, int]) -> set[int]:
    reached: set[int] = set()
    seen: set[int] = set()
    stack = list(node.input_tensors)
    while stack:
        tensor = stack.pop()
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if id(tensor) in position:
            reached.add(position[id(tensor)])
        elif (parent := producer.get(id(tensor))) is not None:
            stack.extend(parent.input_tensors)
    return reached


def _row(inputs: Sequence[Any], length: int) -> list[np.ndarray]:
    # Ones: a token id every vocabulary has, a padding mask that keeps every position.
    return [
        np.ones((1, *(length if d is None else int(d) for d in t.shape[1:])), dtype=str(t.dtype))
        for t in inputs
    ]


def probe_bound(model: Any, inputs: Sequence[Any], ceiling: int) -> LengthBound | None:
    """Run ``model`` on one row at growing lengths up to ``ceiling``; the longest that runs
    where a longer one fails after a shorter one ran, else ``None``."""
    unknown = frozenset(i for i, t in enumerate(inputs) if None in tuple(t.shape[1:]))
    if not unknown:
        return None

    def runs(length: int) -> bool:
        arrays = _row(inputs, length)
        try:
            model(keras.tree.pack_sequence_as(model._inputs_struct, arrays), training=False)
        except Exception:
            return False
        return True

    # Most models run at the ceiling: one call tells.
    if runs(ceiling):
        return None
    good, bad = 0, ceiling
    length = 1
    while length < ceiling:
        if runs(length):
            good = length
        elif good:
            bad = length
            break
        length *= 2
    if not good:
        return None  # nothing runs: not a length the probe can tell; the warm-up will say why
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if runs(middle) else (good, middle)
    source = f"the model runs one row of length {good} and fails at {good + 1}"
    return LengthBound(good, unknown, source)


def bound_signature(signature: ModelSignature, bounds: Sequence[LengthBound]) -> ModelSignature:
    """``signature`` with each input's ``max_length``: the shortest bound over it."""
    specs = []
    for i, spec in enumerate(signature.inputs):
        lengths = [b.length for b in bounds if i in b.inputs]
        if lengths and None in spec.shape:
            spec = replace(spec, max_length=min(lengths))
        specs.append(spec)
    return replace(signature, inputs=tuple(specs))


def tightest(bounds: Sequence[LengthBound]) -> LengthBound | None:
    return min(bounds, key=lambda b: b.length, default=None)


def describe_bounds(signature: ModelSignature) -> str | None:
    """One line naming the inputs whose length the model bounds; None when none is."""
    bounded = [f"{t.name}={t.max_length}" for t in signature.inputs if t.max_length is not None]
    if not bounded:
        return None
    return f"the longest inputs the model takes (positions): {', '.join(bounded)}"
