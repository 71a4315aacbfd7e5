"""The split bench's models (built in code, seeded) and their batches: a recommender of two
tables, and an MLP whose ``fc1 -> fc2`` the planner pairs."""

from __future__ import annotations

from typing import Any

import numpy as np

HISTORY = 20


def build(rows: int, dim: int) -> Any:
    """Two tables of ``rows`` x ``dim``, an MLP, a score."""
    import keras

    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=1)
    history = keras.Input((HISTORY,), dtype="int32", name="history")
    item = keras.Input((1,), dtype="int32", name="item")
    user = keras.Input((1,), dtype="int32", name="user")
    items = keras.layers.Embedding(
        rows, dim, mask_zero=True, embeddings_initializer=init, name="items"
    )
    users = keras.layers.Embedding(rows, dim, embeddings_initializer=init, name="users")
    x = keras.layers.Concatenate(name="features")(
        [
            keras.layers.GlobalAveragePooling1D(name="pool")(items(history)),
            keras.layers.Flatten(name="candidate")(items(item)),
            keras.layers.Flatten(name="user_vector")(users(user)),
        ]
    )
    x = keras.layers.Dense(128, activation="relu", kernel_initializer=init, name="mlp")(x)
    score = keras.layers.Dense(1, kernel_initializer=init, name="score")(x)
    return keras.Model([history, item, user], score, name="split_rec")


def build_mlp(width: int, hidden: int) -> Any:
    """x -> fc1 (relu) -> fc2 -> a score: fc1 and fc2 both too large for the split budget, an
    elementwise activation between them, so the planner pairs them."""
    import keras

    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=2)
    x = keras.Input((width,), name="x")
    h = keras.layers.Dense(hidden, activation="relu", kernel_initializer=init, name="fc1")(x)
    y = keras.layers.Dense(width, kernel_initializer=init, name="fc2")(h)
    score = keras.layers.Dense(1, kernel_initializer=init, name="score")(y)
    return keras.Model(x, score, name="split_mlp")


def inputs(model: str, batch: int, rows: int, width: int, seed: int) -> dict[str, np.ndarray]:
    """One seeded batch: uniform ids (half the histories padded with zeros after 10), or
    normal features for the MLP."""
    rng = np.random.default_rng(seed)
    if model == "mlp":
        return {"x": rng.normal(size=(batch, width)).astype("float32")}
    history = rng.integers(1, rows, size=(batch, HISTORY)).astype("int32")
    history[:, HISTORY // 2 :] *= rng.integers(0, 2, size=(batch, 1)).astype("int32")
    return {
        "history": history,
        "item": rng.integers(1, rows, size=(batch, 1)).astype("int32"),
        "user": rng.integers(0, rows, size=(batch, 1)).astype("int32"),
    }
