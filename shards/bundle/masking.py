"""The layer that gives a stage input back the Keras mask it carried in the whole model.

Keras hands an implicit mask (``Embedding(mask_zero=True)``) from layer to layer as an attribute
of the tensor, and ``MultiHeadAttention`` reads it from there, not from an argument. A tensor
that crosses a cut arrives as a bare array, so its mask crosses as a tensor of its own and this
layer attaches it again before the stage's first read. Importing this module registers the
layer, which every stage file that holds one needs before it loads (``shards.bundle.format``).
"""

from __future__ import annotations

from typing import Any

import keras


@keras.saving.register_keras_serializable(package="shardserve")
class CarryMask(keras.layers.Layer):  # type: ignore[misc]
    """Identity on its input; its output carries ``mask``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs: Any, mask: Any = None) -> Any:
        return inputs

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return mask

    def compute_output_shape(self, input_shape: Any) -> Any:
        return input_shape
