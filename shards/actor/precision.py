"""Reduced precision in a stage actor: activations cast at a cut, weights held in 16 bits.

numpy has no bfloat16; ``ml_dtypes`` (TensorFlow depends on it) adds it. It is imported only in
the shard actors: the driver forwards the references of cast tensors and never reads one (model
outputs go back in the dtype the model computes them in).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from shards.bundle.tensor_routes import cut_tensors
from shards.dtypes import check_reduced

if TYPE_CHECKING:
    import keras

    from shards.bundle.format import Manifest

_FLOATS = ("float32", "float64")


def numpy_dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def cut_casts(
    manifest: Manifest, stage_index: int, activation_dtype: str | None
) -> dict[str, np.dtype[Any]]:
    """The stage's float outputs that cross a cut only (a later stage reads them, the driver
    does not), each with the dtype it travels in; empty when activations stay as they are."""
    reduced = check_reduced(activation_dtype, "activation_dtype")
    if reduced is None:
        return {}
    crossing = cut_tensors(manifest)[stage_index]
    target = numpy_dtype(reduced)
    return {
        t.name: target
        for t in manifest.stages[stage_index].outputs
        if t.name in crossing and t.dtype in _FLOATS
    }


def variable_bytes(model: keras.Model) -> int:
    """Bytes of the model's variables, from their shapes and dtypes (no copy of the values)."""
    return sum(
        math.prod(v.shape) * np.dtype(numpy_dtype(str(v.dtype))).itemsize for v in model.weights
    )


def serve_weights_in(model: keras.Model, weight_dtype: str) -> keras.Model:
    """The same stage with its float variables held in ``weight_dtype`` and computing in
    float32: each layer reads its weights rounded to 16 bits and cast up (Keras autocasting), so
    the weights take half the memory and only their rounding changes the outputs.

    The stage is rebuilt from its own config, so the float32 variables are copied one at a time
    into the narrower ones and then freed: a peak of 1.5x the float32 weights while it runs.
    """
    import keras

    reduced = check_reduced(weight_dtype, "weight_dtype")
    if reduced is None:
        return model
    if any(isinstance(layer, keras.layers.TFSMLayer) for layer in model.layers):
        raise ValueError(
            f"weight_dtype={weight_dtype!r} needs .keras stages; this stage is a SavedModel"
        )
    # Keras turns a policy in a layer's config back into its name, so the float32 layers get
    # none and take the global policy, set to the stored-in one while the stage is rebuilt.
    config = _without_float32_policy(model.get_config())
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(_stored_in_policy()(reduced))
    try:
        narrow = keras.Model.from_config(config)
    finally:
        keras.config.set_dtype_policy(previous)
    for target, source in zip(narrow.weights, model.weights, strict=True):
        target.assign(source)
    return narrow


def _stored_in_policy() -> type:
    import keras

    class ShardserveWeightsIn(keras.DTypePolicy):  # type: ignore[misc]
        """Variables in the policy's name (a 16-bit float), computation in float32."""

        def _parse_name(self, name: str) -> tuple[str, str]:
            return "float32", name

    return ShardserveWeightsIn


def _without_float32_policy(config: Any) -> Any:
    """A (nested) layer config with every float32 layer policy left out (None: the global)."""
    if isinstance(config, list):
        return [_without_float32_policy(c) for c in config]
    if not isinstance(config, dict):
        return config
    if config.get("class_name") == "DTypePolicy" and config.get("config", {}).get("name") == (
        "float32"
    ):
        return None
    return {k: _without_float32_policy(v) for k, v in config.items()}
