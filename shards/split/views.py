"""A part's weights as views of the layer it splits: nothing is held until a stage is written.

The rewritten model (``shards.split.rewrite``) holds every part of a split layer at once. Were
each part's weights copied into it, the partitioner would hold the model and all its parts (a
second model) until the last stage is written. Instead each part's variable is built empty (a
Keras variable created in ``StatelessScope(initialize_variables=False)`` holds no value) with a
``SliceOf`` as its initializer, which Keras reads for the variable's value each time one is
asked for and keeps nothing: traced (a graph: shape inference, cutting the stages), it is a slice
op on the source variable; run eagerly, the slice itself, made then and dropped after. The
stages are written one after another (``shards.partition.cut``), so the partitioner holds the
model plus one part's slice at a time; a part layer hands its slice to Keras's weight store as
the store's own (``stored``), so Keras does not copy it again: a range of a table's rows is
written out of the table's own buffer, a range of columns (or a tied table's rows transposed for
its logits) is one copy, dropped once it is written.

Keras initialises such variables when the outermost stateless scope ends (``compute_output_spec``
opens one per traced call); a view is taken out of Keras's list of them so that it never is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

__all__ = ["SliceOf", "build_viewing", "holds_value", "stored"]


@dataclass(frozen=True, eq=False)
class SliceOf:
    """``source[..., start:stop, ...]`` along ``axis`` (the whole of ``source`` where ``axis`` is
    None), transposed where ``transpose``: a part's weight read out of the layer it splits, as a
    Keras initializer (called with the variable's shape and dtype)."""

    source: Any
    axis: int | None = None
    start: int = 0
    stop: int = 0
    transpose: bool = False

    def __call__(self, shape: Any = None, dtype: Any = None) -> Any:
        value = self.source.value if hasattr(self.source, "value") else self.source
        # Indexed even whole: a read of the source (a tensor, not the source's own variable).
        index = [slice(None)] * len(value.shape)
        if self.axis is not None:
            index[self.axis] = slice(self.start, self.stop)
        value = value[tuple(index)]
        if self.transpose:
            value = keras.ops.transpose(value)
        if dtype is not None and keras.backend.standardize_dtype(value.dtype) != dtype:
            value = keras.ops.cast(value, dtype)
        return value


def build_viewing(layer: keras.layers.Layer, sources: Mapping[str, SliceOf]) -> None:
    """Build ``layer`` (its ``build(None)`` makes every weight from its own config) with each
    weight named in ``sources`` a view of its source: no value held (``holds_value``)."""
    from keras.src.backend.common import global_state

    with keras.StatelessScope(initialize_variables=False):
        layer.build(None)
    missing = [v.name for v in layer.weights if v.name not in sources]
    if missing:
        raise ValueError(f"layer {layer.name!r}: no source for its weight(s) {missing}")
    for variable in layer.weights:
        variable._initializer = sources[variable.name]
    # Keras would initialise them at the next outermost stateless scope's end: none of them is.
    made = {id(v) for v in layer.weights}
    pending = global_state.get_global_attribute("uninitialized_variables", [])
    kept = [v for v in pending if id(v) not in made]
    global_state.set_global_attribute("uninitialized_variables", kept)


def holds_value(variable: Any) -> bool:
    """Whether a Keras variable holds its value (False for a view)."""
    return getattr(variable, "_value", None) is not None


class _Handed:
    """An array handed to Keras's weight store as a copy of its own: the store's ``np.array``
    takes it as it is (``__array__`` answers a request for a copy with it). The store only reads
    it, to write it, so it may be the source's own buffer (a table's rows)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return self.array if dtype is None else self.array.astype(dtype, copy=False)


def stored(variable: Any) -> Any:
    """What a part layer hands Keras's weight store for ``variable`` (``save_own_variables``):
    a view's slice, read once, as an array the store writes without copying it again (a table's
    rows: the source's own buffer, written in place); any other variable as it is."""
    view = None if holds_value(variable) else getattr(variable, "_initializer", None)
    if not isinstance(view, SliceOf):
        return variable
    return _Handed(np.asarray(view(variable.shape, variable.dtype)))
