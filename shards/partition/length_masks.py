"""Which model inputs the model masks along their unknown dimension (a sequence length), found
when the model is cut, and the value that marks a masked position: ``TensorSpec.pad_value``.

Rows padded with that value answer as they would unpadded, which lets the server batch rows of
different lengths together (issue 19). Two patterns are recognised:

- an input with one unknown dimension that an ``Embedding(mask_zero=True)`` (or any layer with
  ``mask_zero=True``) reads directly: token 0 is masked, so it pads with 0;
- keras_hub's ``padding_mask`` input (or ``<prefix>padding_mask``, as seq2seq models name
  theirs): it pads with 0 (``False`` for a bool mask), and so do the inputs beside it of the
  same length (``token_ids``, ``segment_ids``; those sharing its prefix), whose padded
  positions the mask hides.

A pattern found here is a promise of the model's author, not a proof: the server still checks
at warm-up that padding leaves the answers unchanged before it pads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import keras

from shards.signature import ModelSignature, PadValue, TensorSpec

PADDING_MASK = "padding_mask"


def _zero(dtype: str) -> PadValue:
    if dtype == "bool":
        return False
    return 0.0 if dtype.startswith(("float", "bfloat")) else 0


def _unknown_axis(spec: TensorSpec) -> int | None:
    """The one unknown dimension of ``spec``; None when it has none or several."""
    unknown = [axis for axis, d in enumerate(spec.shape) if d is None]
    return unknown[0] if len(unknown) == 1 else None


def _read_by_mask_zero(inputs: Sequence[Any], nodes: Sequence[Any]) -> set[int]:
    """Positions in ``inputs`` of the model inputs a ``mask_zero`` layer reads directly."""
    position = {id(t): i for i, t in enumerate(inputs)}
    found: set[int] = set()
    for node in nodes:
        if getattr(node.operation, "mask_zero", False) is not True:
            continue
        for tensor in keras.tree.flatten(node.arguments.args[:1]):
            if id(tensor) in position:
                found.add(position[id(tensor)])
    return found


def _beside_padding_masks(specs: Sequence[TensorSpec]) -> set[int]:
    """Positions of the padding-mask inputs and of the inputs of the same length beside them."""
    found: set[int] = set()
    for mask in specs:
        axis = _unknown_axis(mask)
        if not mask.name.endswith(PADDING_MASK) or axis is None:
            continue
        prefix = mask.name[: -len(PADDING_MASK)]
        for i, spec in enumerate(specs):
            same_length = len(spec.shape) == len(mask.shape) and _unknown_axis(spec) == axis
            if same_length and spec.name.startswith(prefix):
                found.add(i)
    return found


def mark_masked_inputs(
    signature: ModelSignature, inputs: Sequence[Any], nodes: Sequence[Any]
) -> ModelSignature:
    """``signature`` with a pad value on each input the model masks. ``inputs``: the model's
    input KerasTensors in the signature's order; ``nodes``: its Keras nodes (layer calls)."""
    masked = _read_by_mask_zero(inputs, nodes) | _beside_padding_masks(signature.inputs)
    specs = tuple(
        replace(spec, pad_value=_zero(spec.dtype))
        if i in masked and _unknown_axis(spec) is not None
        else spec
        for i, spec in enumerate(signature.inputs)
    )
    return replace(signature, inputs=specs)


def describe_pad_values(signature: ModelSignature) -> str | None:
    """One line naming the inputs padded by length and their pad values; None when none is."""
    padded = [f"{t.name}={t.pad_value!r}" for t in signature.inputs if t.pad_value is not None]
    if not padded:
        return None
    return f"inputs the model masks (length padding pads them): {', '.join(padded)}"
