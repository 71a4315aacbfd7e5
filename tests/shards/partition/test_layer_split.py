"""A layer larger than one device split into parts (issue 29), cut and run as a chain here; the
same served by real stage actors: tests/e2e/test_split_server.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from shards.bundle.format import BundleError, Manifest, read_manifest
from shards.partition.cut import partition_to_bundle, run_chain
from shards.partition.demo_models import demo_recommender
from shards.partition.plan import PlanError

# Under it, the recommender's 768 000-byte item table is split by rows (batch 8, no overhead).
BUDGET = 600_000


def recommender_inputs(rows: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    history = rng.integers(1, 6000, size=(rows, 20)).astype("int32")
    history[1:, 12:] = 0  # padding: the masked pooling must skip it as the whole model does
    return {
        "history": history,
        "item": rng.integers(1, 6000, size=(rows, 1)).astype("int32"),
        "user": rng.integers(0, 1000, size=(rows, 1)).astype("int32"),
    }


def whole(model: keras.Model, inputs: dict[str, np.ndarray]) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(model([inputs[t.name] for t in model.inputs])))


def test_the_item_table_is_split_by_rows_and_answers_equal(tmp_path: Path) -> None:
    model, inputs = demo_recommender(), recommender_inputs()
    manifest = partition_to_bundle(
        model, tmp_path / "b", max_stage_bytes=BUDGET, plan_batch_rows=8, device_overhead_bytes=0
    )
    assert [s.name for s in manifest.stages] == ["0.0", "0.1", "1"]
    assert all(s.planned_peak_bytes <= BUDGET for s in manifest.stages)
    (split,) = manifest.splits()
    assert (split["layer"], split["how"], split["parts"]) == ("items", "rows", 2)
    assert [(p["start"], p["stop"]) for p in split["stages"]] == [(0, 3000), (3000, 6000)]
    assert [p["weight_bytes"] for p in split["stages"]] == [384_000, 384_000]
    # Both parts read the same request tensors, and neither reads the other's output.
    assert [t.name for t in manifest.stages[0].inputs] == ["history", "item"]
    assert [t.name for t in manifest.stages[1].inputs] == ["history", "item"]
    # A lookup split by rows adds each row to zeros: exact, so the rest of the model is too.
    got = run_chain(tmp_path / "b", inputs)["scores"]
    np.testing.assert_array_equal(got, whole(model, inputs))


def test_an_id_outside_the_vocabulary_raises_as_the_whole_model_does(tmp_path: Path) -> None:
    model, inputs = demo_recommender(), recommender_inputs()
    partition_to_bundle(
        model, tmp_path / "b", max_stage_bytes=BUDGET, plan_batch_rows=8, device_overhead_bytes=0
    )
    # Keras's lookup counts a negative id from the end of the table: so do the parts.
    inputs["item"][1, 0] = -1
    np.testing.assert_array_equal(run_chain(tmp_path / "b", inputs)["scores"], whole(model, inputs))
    for bad, read in ((6000, 6000), (-6001, -1)):
        inputs["item"][1, 0] = bad
        message = rf"indices\[1,0\] = {read} is not in \[0, 6000\)"
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            whole(model, inputs)
        # Each part checks the whole vocabulary: not zeros from every part, the same error.
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            run_chain(tmp_path / "b", inputs)


def test_a_wide_dense_is_split_by_columns_too(tmp_path: Path) -> None:
    model, inputs = demo_recommender(), recommender_inputs()
    manifest = partition_to_bundle(
        model, tmp_path / "b", max_stage_bytes=100_000, plan_batch_rows=1, device_overhead_bytes=0
    )
    parts = {s.part.layer: s.part.parts for s in manifest.stages if s.part}
    assert parts == {"items": 8, "scores": 2}
    assert [s.name for s in manifest.stages if s.part and s.part.layer == "scores"] == [
        "3.0",
        "3.1",
    ]
    # A column slice may take another matrix kernel: 1e-6 relative.
    want = whole(model, inputs)
    np.testing.assert_allclose(run_chain(tmp_path / "b", inputs)["scores"], want, rtol=1e-6)


def test_a_masked_lookup_crosses_the_split_exactly(tmp_path: Path) -> None:
    ids = keras.Input((6,), dtype="int32", name="ids")
    table = keras.layers.Embedding(4000, 16, mask_zero=True, name="table")
    x = table(ids)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    model = keras.Model(ids, [x, pooled], name="lookup")
    rows = np.array([[5, 3999, 2000, 0, 0, 0], [1, 2, 3, 4, 5, 6]], dtype="int32")
    partition_to_bundle(
        model, tmp_path / "b", max_stage_bytes=150_000, plan_batch_rows=4, device_overhead_bytes=0
    )
    got = run_chain(tmp_path / "b", {"ids": rows})
    want = [keras.ops.convert_to_numpy(t) for t in model(rows)]
    np.testing.assert_array_equal(got["table"], want[0])
    np.testing.assert_array_equal(got["pool"], want[1])


def test_an_einsum_dense_is_split_along_its_output_units(tmp_path: Path) -> None:
    x = keras.Input((4, 32), name="x")
    y = keras.layers.EinsumDense(
        "abc,cd->abd", output_shape=(None, 2048), bias_axes="d", activation="softmax", name="wide"
    )(x)
    model = keras.Model(x, y, name="einsum")
    manifest = partition_to_bundle(
        model, tmp_path / "b", max_stage_bytes=200_000, plan_batch_rows=1, device_overhead_bytes=0
    )
    assert {s.part.layer for s in manifest.stages if s.part} == {"wide"}
    rows = np.random.default_rng(1).normal(size=(3, 4, 32)).astype("float32")
    want = keras.ops.convert_to_numpy(model(rows))
    np.testing.assert_allclose(run_chain(tmp_path / "b", {"x": rows})["wide"], want, rtol=1e-6)


def test_a_kind_that_cannot_be_split_is_refused_by_name(tmp_path: Path) -> None:
    image = keras.Input((8, 8, 64), name="image")
    y = keras.layers.Conv2D(256, 3, name="big_conv")(image)
    model = keras.Model(image, keras.layers.GlobalMaxPooling2D(name="pool")(y))
    with pytest.raises(
        PlanError,
        match=r"layer 'big_conv' alone holds .* more than max_stage_bytes=100000 .* A Conv2D "
        r"cannot be split across devices: the kinds that can are Embedding \(mask_zero too\), "
        r"keras_hub's ReversibleEmbedding, Dense and EinsumDense",
    ):
        partition_to_bundle(
            model,
            tmp_path / "b",
            max_stage_bytes=100_000,
            plan_batch_rows=1,
            device_overhead_bytes=0,
        )


def test_a_bundle_of_format_2_is_refused_with_the_way_out(tmp_path: Path) -> None:
    partition_to_bundle(demo_recommender(), tmp_path / "b", stages=1)
    path = tmp_path / "b" / "manifest.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"format_version": 2}))
    with pytest.raises(BundleError, match=r"format_version 2.*re-partition the source model"):
        read_manifest(tmp_path / "b")


def tiny_gpt2(vocabulary: int = 5000, length: int = 8) -> keras.Model:
    """keras_hub's GPT2CausalLM, built in code (no download), whose ReversibleEmbedding is both
    its token lookup and, tied, its logits over the vocabulary."""
    import keras_hub

    keras.utils.set_random_seed(3)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=length,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def partition_gpt2(model: keras.Model, bundle: Path, **options: Any) -> Manifest:
    """``tiny_gpt2`` cut under a budget (400,000 bytes) smaller than its table and its logits."""
    return partition_to_bundle(
        model,
        bundle,
        max_stage_bytes=400_000,
        plan_batch_rows=1,
        device_overhead_bytes=0,
        max_sequence_length=8,
        **options,
    )


def gpt2_inputs(vocabulary: int = 5000, length: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    mask = np.ones((3, length), "int32")
    mask[1, length // 2 :] = 0
    return {
        "token_ids": rng.integers(0, vocabulary, (3, length)).astype("int32"),
        "padding_mask": mask,
    }


def test_a_tied_embedding_is_split_once_for_its_lookup_and_its_logits(tmp_path: Path) -> None:
    model, inputs = tiny_gpt2(), gpt2_inputs()
    # The 5000 x 16 table (320 000 bytes) is larger than the budget; so are its logits.
    manifest = partition_gpt2(model, tmp_path / "b")
    lookup, logits = manifest.splits()
    assert (lookup["layer"], lookup["use"], logits["layer"], logits["use"]) == (
        "token_embedding",
        None,
        "token_embedding",
        "logits",
    )
    # Split once: the same row ranges serve both uses, each use's parts holding them.
    ranges = [[(p["start"], p["stop"]) for p in s["stages"]] for s in (lookup, logits)]
    assert ranges[0] == ranges[1] == [(0, 2500), (2500, 5000)]
    assert [p["weight_bytes"] for s in (lookup, logits) for p in s["stages"]] == [160_000] * 4
    assert [p["label"] for p in logits["stages"]] == ["2.0", "2.1"]
    assert all(s.planned_peak_bytes <= 400_000 for s in manifest.stages)
    # The logits are a column slice of a matrix product: 1e-6 relative.
    (got,) = run_chain(tmp_path / "b", inputs).values()
    want = keras.ops.convert_to_numpy(model(inputs))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_token_and_position_embedding_splits_its_token_table(tmp_path: Path) -> None:
    import keras_hub

    keras.utils.set_random_seed(4)
    ids = keras.Input((8,), dtype="int32", name="ids")
    tokens = keras_hub.layers.TokenAndPositionEmbedding(4000, 8, 16, mask_zero=True, name="tokens")
    x = tokens(ids)
    model = keras.Model(ids, [x, keras.layers.GlobalAveragePooling1D(name="pool")(x)])
    manifest = partition_to_bundle(
        model, tmp_path / "b", max_stage_bytes=150_000, plan_batch_rows=2, device_overhead_bytes=0
    )
    (split,) = manifest.splits()
    assert (split["layer"], split["kind"], split["parts"]) == (
        "tokens",
        "TokenAndPositionEmbedding",
        2,
    )
    rows = np.array([[5, 3999, 2000, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]], dtype="int32")
    got = run_chain(tmp_path / "b", {"ids": rows})
    want = [keras.ops.convert_to_numpy(t) for t in model(rows)]
    # The token rows are exact, the positions added after them as the layer adds them, and the
    # padding mask crosses the split (the pooling skips the padded positions).
    np.testing.assert_array_equal(got["tokens"], want[0])
    np.testing.assert_array_equal(got["pool"], want[1])
