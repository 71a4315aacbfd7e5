"""The inputs a model masks along their unknown length get a pad value when it is cut, and the
bundle's manifest carries it to the server."""

from __future__ import annotations

from pathlib import Path

import keras

from shards.bundle.format import read_manifest
from shards.partition.cut import partition_to_bundle
from shards.partition.graph import analyse


def pad_values(model: keras.Model) -> dict[str, object]:
    return {t.name: t.pad_value for t in analyse(model).signature.inputs}


def embedded(tokens: keras.KerasTensor, mask_zero: bool) -> keras.KerasTensor:
    x = keras.layers.Embedding(50, 4, mask_zero=mask_zero, name="emb")(tokens)
    return keras.layers.GlobalAveragePooling1D(name="pool")(x)


def test_an_unknown_length_input_read_by_a_mask_zero_embedding_pads_with_zero() -> None:
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    # Another input of unknown length that no mask covers: not padded.
    scores = keras.Input((None,), dtype="float32", name="scores")
    pooled = keras.layers.Concatenate(name="join")(
        [embedded(tokens, mask_zero=True), keras.ops.mean(scores, axis=1, keepdims=True)]
    )
    model = keras.Model([tokens, scores], keras.layers.Dense(2, name="out")(pooled))
    assert pad_values(model) == {"tokens": 0, "scores": None}


def test_no_pad_value_without_the_mask_or_without_an_unknown_length() -> None:
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    assert pad_values(keras.Model(tokens, embedded(tokens, mask_zero=False))) == {"tokens": None}
    fixed = keras.Input((7,), dtype="int32", name="tokens")
    assert pad_values(keras.Model(fixed, embedded(fixed, mask_zero=True))) == {"tokens": None}


def padding_mask_model(mask_dtype: str) -> keras.Model:
    """keras_hub's layout: token and segment ids beside a padding mask of the same length."""
    inputs = {
        "token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
        "segment_ids": keras.Input((None,), dtype="int32", name="segment_ids"),
        "padding_mask": keras.Input((None,), dtype=mask_dtype, name="padding_mask"),
        # Per-row features of another shape: not of the masked length.
        "extra": keras.Input((None, 3), dtype="float32", name="extra"),
    }
    x = keras.layers.Embedding(50, 4, name="tok")(inputs["token_ids"])
    x = x + keras.layers.Embedding(2, 4, name="seg")(inputs["segment_ids"])
    weight = keras.ops.expand_dims(keras.ops.cast(inputs["padding_mask"], "float32"), -1)
    pooled = (
        keras.ops.sum(x * weight, axis=1) + keras.ops.sum(inputs["extra"], axis=(1, 2))[:, None]
    )
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(pooled))


def test_a_padding_mask_and_its_same_length_inputs_pad_with_zero() -> None:
    want = {"token_ids": 0, "segment_ids": 0, "padding_mask": 0, "extra": None}
    assert pad_values(padding_mask_model("int32")) == want
    got = pad_values(padding_mask_model("bool"))
    assert got == {**want, "padding_mask": False}
    assert got["padding_mask"] is False


def test_the_manifest_carries_the_pad_values(tmp_path: Path) -> None:
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    model = keras.Model(tokens, keras.layers.Dense(2, name="out")(embedded(tokens, True)))
    lines: list[str] = []
    partition_to_bundle(model, tmp_path / "b", stages=1, progress=lines.append)
    assert read_manifest(tmp_path / "b").signature.inputs[0].pad_value == 0
    assert "inputs the model masks (length padding pads them): tokens=0" in lines
