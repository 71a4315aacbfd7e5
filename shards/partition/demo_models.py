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

Three token models, ``Input((None,), "int32")`` named ``tokens`` (100 ids, 0 the padding),
for variable-length inputs (issue 19); each cuts in 2 stages, about 0.5-1 ms at 32 x 64 tokens
unless said:

- ``demo-tokens``: ``Embedding(mask_zero=True)`` -> Dense(32, relu) -> masked average pooling
  -> 4 logits; zero-padded rows answer as unpadded ones.
- ``demo-tagger``: the same masked embedding -> Dense(32, relu) -> self-attention (2 heads),
  residual, layer norm -> 8 logits per token ``(n, L, 8)``; the mask crosses its cut. About
  3 ms at 32 x 64.
- ``demo-conv1d``: no mask: Embedding -> Conv1D(16, 3, same) -> global max pooling -> 4 logits;
  padding changes its answers, so it must be served unpadded.

``demo_recommender()`` (issue 29; built in code for tests and benchmarks, not one of the names
``shardserve`` takes: save it to a ``.keras`` file to serve it): a 6000 x 32 item table
(``mask_zero``, read for a history of 20 ids and for the candidate item), a 1000 x 16 user
table, an MLP and a 1000-wide score layer; under a budget of a few hundred KiB its item table
is split across devices.
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


VOCABULARY = 100


def _tokens(seeds: count[int], mask_zero: bool) -> tuple[keras.KerasTensor, keras.KerasTensor]:
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(
        VOCABULARY, 16, mask_zero=mask_zero, embeddings_initializer=_init(seeds), name="embedding"
    )(tokens)
    return tokens, embedded


def _dense(
    x: keras.KerasTensor, width: int, name: str, seeds: count[int], **kw: str
) -> keras.KerasTensor:
    return keras.layers.Dense(
        width, kernel_initializer=_init(seeds), bias_initializer=_bias(seeds), name=name, **kw
    )(x)


def demo_tokens() -> keras.Model:
    seeds = count(400)
    tokens, x = _tokens(seeds, mask_zero=True)
    x = _dense(x, 32, "hidden", seeds, activation="relu")
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(tokens, _dense(x, 4, "logits", seeds), name="demo_tokens")


def demo_tagger() -> keras.Model:
    seeds = count(500)
    tokens, x = _tokens(seeds, mask_zero=True)
    x = _dense(x, 32, "hidden", seeds, activation="relu")
    attended = keras.layers.MultiHeadAttention(
        2,
        16,
        kernel_initializer=_init(seeds),
        bias_initializer=_bias(seeds),
        name="attention",
    )(x, x)
    x = keras.layers.LayerNormalization(name="norm")(
        keras.layers.Add(name="residual")([x, attended])
    )
    return keras.Model(tokens, _dense(x, 8, "logits", seeds), name="demo_tagger")


def demo_conv1d() -> keras.Model:
    seeds = count(600)
    tokens, x = _tokens(seeds, mask_zero=False)
    x = keras.layers.Conv1D(
        16,
        3,
        padding="same",
        kernel_initializer=_init(seeds),
        bias_initializer=_bias(seeds),
        name="conv",
    )(x)
    x = keras.layers.GlobalMaxPooling1D(name="pool")(x)
    return keras.Model(tokens, _dense(x, 4, "logits", seeds), name="demo_conv1d")


# demo-recommender's sizes: a 768 KiB item table, a 1000-item score layer.
ITEMS, USERS, HISTORY = 6000, 1000, 20


def demo_recommender() -> keras.Model:
    """Two tables: items (``mask_zero``, read twice: the history and the candidate) and users;
    an MLP over the pooled history, the candidate and the user; a wide score layer."""
    seeds = count(700)
    history = keras.Input((HISTORY,), dtype="int32", name="history")
    item = keras.Input((1,), dtype="int32", name="item")
    user = keras.Input((1,), dtype="int32", name="user")
    items = keras.layers.Embedding(
        ITEMS, 32, mask_zero=True, embeddings_initializer=_init(seeds), name="items"
    )
    users = keras.layers.Embedding(USERS, 16, embeddings_initializer=_init(seeds), name="users")
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(items(history))
    x = keras.layers.Concatenate(name="features")(
        [
            pooled,
            keras.layers.GlobalAveragePooling1D(name="candidate")(items(item)),
            keras.layers.Flatten(name="user_vector")(users(user)),
        ]
    )
    x = _dense(x, 64, "hidden_0", seeds, activation="relu")
    x = _dense(x, 32, "hidden_1", seeds, activation="relu")
    scores = _dense(x, 1000, "scores", seeds)
    return keras.Model([history, item, user], scores, name="demo_recommender")


DEMO_MODELS: dict[str, Callable[[], keras.Model]] = {
    "demo-tiny": demo_tiny,
    "demo-mlp": demo_mlp,
    "demo-resnet": demo_resnet,
    "demo-tokens": demo_tokens,
    "demo-tagger": demo_tagger,
    "demo-conv1d": demo_conv1d,
}


def build_demo(name: str) -> keras.Model:
    try:
        build = DEMO_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown demo model {name!r}; the demo models are {', '.join(sorted(DEMO_MODELS))}"
        ) from None
    return build()
