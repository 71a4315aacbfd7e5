"""Built-in demo models, made in code: no downloads, and identical weights every time they are
built, in any process (every initializer carries its own seed; nothing reads global RNG state).

Measured once on the 2-core CPU machine (TF 2.21, Keras 3.15), one process, batch of 32 rows
through a ``tf.function`` (as a stage actor runs it; eager calls take 2-4x longer):

- ``demo-tiny``: 8 -> 16 -> 16 -> 4, 484 parameters, about 0.5 ms; for fast tests.
- ``demo-mlp``: 1024 features, 8 hidden layers of 2048 (ReLU), 10 logits: 31.5M parameters
  (126 MB), 63 MFLOPs per row; about 23 ms (the 8 x 2048 MLP of the architecture guide's numbers).
- ``demo-resnet``: 32x32x3 image, a stem and 3 stages of 2 residual blocks (16, 32, 64
  channels, batch norm), 10 logits: 0.18M parameters, about 54 MFLOPs per row (estimated);
  about 22 ms.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import count

import keras


def _init(seeds: count[int]) -> keras.initializers.Initializer:
    return keras.initializers.GlorotUniform(seed=next(seeds))


def _bias(seeds: count[int]) -> keras.initializers.Initializer:
    # Non-zero biases so that a dropped or misrouted bias shows up in comparisons.
    return keras.initializers.RandomUniform(-0.05, 0.05, seed=next(seeds))


def _mlp(name: str, n_in: int, hidden: list[int], n_out: int, seed: int) -> keras.Model:
    seeds = count(seed)
    features = keras.Input((n_in,), name="features")
    x = features
    for i, width in enumerate(hidden):
        x = keras.layers.Dense(
            width,
            activation="relu",
            kernel_initializer=_init(seeds),
            bias_initializer=_bias(seeds),
            name=f"dense_{i}",
        )(x)
    logits = keras.layers.Dense(
        n_out, kernel_initializer=_init(seeds), bias_initializer=_bias(seeds), name="logits"
    )(x)
    return keras.Model(features, logits, name=name)


def demo_tiny() -> keras.Model:
    return _mlp("demo_tiny", 8, [16, 16], 4, seed=100)


def demo_mlp() -> keras.Model:
    return _mlp("demo_mlp", 1024, [2048] * 8, 10, seed=200)


def _conv(
    x: keras.KerasTensor, filters: int, stride: int, name: str, seeds: count[int]
) -> keras.KerasTensor:
    x = keras.layers.Conv2D(
        filters,
        3,
        strides=stride,
        padding="same",
        use_bias=False,
        kernel_initializer=_init(seeds),
        name=f"{name}_conv",
    )(x)
    return keras.layers.BatchNormalization(name=f"{name}_bn")(x)


def _block(
    x: keras.KerasTensor, filters: int, stride: int, name: str, seeds: count[int]
) -> keras.KerasTensor:
    y = keras.layers.Activation("relu", name=f"{name}_relu1")(
        _conv(x, filters, stride, f"{name}_a", seeds)
    )
    y = _conv(y, filters, 1, f"{name}_b", seeds)
    if stride != 1 or x.shape[-1] != filters:
        x = keras.layers.Conv2D(
            filters, 1, strides=stride, kernel_initializer=_init(seeds), name=f"{name}_proj"
        )(x)
    return keras.layers.Activation("relu", name=f"{name}_out")(
        keras.layers.Add(name=f"{name}_add")([x, y])
    )


BLOCKS_PER_STAGE = 2


def demo_resnet() -> keras.Model:
    seeds = count(300)
    image = keras.Input((32, 32, 3), name="image")
    x = keras.layers.Activation("relu", name="stem_relu")(_conv(image, 16, 1, "stem", seeds))
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(BLOCKS_PER_STAGE):
            stride = 2 if stage > 0 and block == 0 else 1
            x = _block(x, filters, stride, f"s{stage}b{block}", seeds)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    logits = keras.layers.Dense(
        10, kernel_initializer=_init(seeds), bias_initializer=_bias(seeds), name="logits"
    )(x)
    return keras.Model(image, logits, name="demo_resnet")


DEMO_MODELS: dict[str, Callable[[], keras.Model]] = {
    "demo-tiny": demo_tiny,
    "demo-mlp": demo_mlp,
    "demo-resnet": demo_resnet,
}


def build_demo(name: str) -> keras.Model:
    try:
        build = DEMO_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown demo model {name!r}; the demo models are {', '.join(sorted(DEMO_MODELS))}"
        ) from None
    return build()
