"""Tiny Keras models of every graph shape the partitioner must cut, each with a batch of inputs."""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np

Inputs = dict[str, np.ndarray]


def _rows(shape: tuple[int, ...], seed: int, n: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, *shape)).astype("float32")


def sequential() -> tuple[keras.Model, Inputs]:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8,), name="features"),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(4),
        ],
        name="seq",
    )
    return model, {"features": _rows((8,), 0)}


def residual() -> tuple[keras.Model, Inputs]:
    keras.utils.set_random_seed(2)
    image = keras.Input((8, 8, 3), name="image")
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="stem")(image)
    for i in range(2):
        y = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name=f"b{i}_conv1")(x)
        y = keras.layers.Conv2D(4, 3, padding="same", name=f"b{i}_conv2")(y)
        x = keras.layers.Add(name=f"b{i}_add")([x, y])
        x = keras.layers.Activation("relu", name=f"b{i}_relu")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    logits = keras.layers.Dense(5, name="logits")(x)
    return keras.Model(image, logits, name="resnet"), {"image": _rows((8, 8, 3), 1)}


def inception() -> tuple[keras.Model, Inputs]:
    keras.utils.set_random_seed(3)
    image = keras.Input((8, 8, 3), name="image")
    a = keras.layers.Conv2D(2, 1, name="branch_1x1")(image)
    b = keras.layers.Conv2D(2, 1, name="branch_3x3_reduce")(image)
    b = keras.layers.Conv2D(3, 3, padding="same", name="branch_3x3")(b)
    c = keras.layers.MaxPooling2D(3, 1, padding="same", name="branch_pool")(image)
    c = keras.layers.Conv2D(2, 1, name="branch_pool_proj")(c)
    x = keras.layers.Concatenate(name="concat")([a, b, c])
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    logits = keras.layers.Dense(4, name="logits")(x)
    return keras.Model(image, logits, name="inception"), {"image": _rows((8, 8, 3), 2)}


def multi_io() -> tuple[keras.Model, Inputs]:
    keras.utils.set_random_seed(4)
    a = keras.Input((6,), name="a")
    b = keras.Input((4,), name="b")
    x = keras.layers.Dense(8, activation="relu", name="da")(a)
    y = keras.layers.Dense(8, activation="relu", name="db")(b)
    z = keras.layers.Concatenate(name="cat")([x, y])
    z = keras.layers.Dense(8, activation="relu", name="mix")(z)
    score = keras.layers.Dense(1, name="score_head")(z)
    klass = keras.layers.Dense(3, name="class_head")(z)
    model = keras.Model({"a": a, "b": b}, {"score": score, "klass": klass}, name="multi")
    return model, {"a": _rows((6,), 3), "b": _rows((4,), 4)}


def reuse() -> tuple[keras.Model, Inputs]:
    keras.utils.set_random_seed(5)
    features = keras.Input((6,), name="features")
    shared = keras.layers.Dense(6, activation="tanh", name="shared")
    x = shared(features)
    x = keras.layers.Dense(6, activation="relu", name="middle")(x)
    x = shared(x)
    x = shared(x)
    out = keras.layers.Dense(2, name="out")(x)
    return keras.Model(features, out, name="reuse"), {"features": _rows((6,), 5)}


def encoder() -> tuple[keras.Model, Inputs]:
    """Transformer-style: the attention mask input feeds every block, so cuts carry 2 tensors."""
    keras.utils.set_random_seed(6)
    seq, dim = 5, 8
    tokens = keras.Input((seq, dim), name="tokens")
    mask = keras.Input((seq, seq), name="mask")
    x = tokens
    for i in range(3):
        att = keras.layers.MultiHeadAttention(2, 4, name=f"att{i}")(x, x, attention_mask=mask)
        x = keras.layers.LayerNormalization(name=f"ln{i}_a")(keras.layers.Add()([x, att]))
        ff = keras.layers.Dense(dim, activation="relu", name=f"ff{i}")(x)
        x = keras.layers.LayerNormalization(name=f"ln{i}_b")(keras.layers.Add()([x, ff]))
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    logits = keras.layers.Dense(3, name="logits")(pooled)
    masks = np.ones((3, seq, seq), "float32")
    masks[:, :, -2:] = 0.0
    return keras.Model([tokens, mask], logits, name="encoder"), {
        "tokens": _rows((seq, dim), 6),
        "mask": masks,
    }


ZOO: dict[str, Callable[[], tuple[keras.Model, Inputs]]] = {
    "sequential": sequential,
    "residual": residual,
    "inception": inception,
    "multi_io": multi_io,
    "reuse": reuse,
    "encoder": encoder,
}


def call_whole(model: keras.Model, inputs: Inputs) -> dict[str, np.ndarray]:
    """The whole model's outputs by the model's own output names."""
    struct = getattr(model, "_inputs_struct", None)
    if isinstance(struct, dict):
        args: object = {k: inputs[k] for k in struct}
    else:
        args = [inputs[t.name] for t in model.inputs]
        if len(model.inputs) == 1:
            args = inputs[model.inputs[0].name]
    out = model(args, training=False)
    # A Sequential model's single output is named after its last layer, as the partitioner does.
    names = getattr(model, "output_names", None) or [model.layers[-1].name]
    if isinstance(out, dict):
        return {k: keras.ops.convert_to_numpy(v) for k, v in out.items()}
    if isinstance(out, list | tuple):
        return {n: keras.ops.convert_to_numpy(v) for n, v in zip(names, out, strict=True)}
    return {names[0]: keras.ops.convert_to_numpy(out)}


def small_bert(positions: int = 32, num_layers: int = 1) -> keras.Model:
    """A keras_hub BERT encoder of ``positions`` positions, small enough for a test (random
    weights, built in code: no download); its position embedding bounds its inputs' length."""
    import keras_hub

    return keras_hub.models.BertBackbone(
        vocabulary_size=100,
        num_layers=num_layers,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=positions,
    )
