"""A layer larger than one device split into parts (issue 29), cut and run as a chain here; the
same served by real stage actors: tests/e2e/test_split_server.py."""

from __future__ import annotations

import json
from pathlib import Path

import keras
import numpy as np
import pytest

from shards.bundle.format import BundleError, read_manifest
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
        model, tmp_path / "b", max_stage_bytes=BUDGET, max_batch_size=8, device_overhead_bytes=0
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


def test_a_wide_dense_is_split_by_columns_too(tmp_path: Path) -> None:
    model, inputs = demo_recommender(), recommender_inputs()
    manifest = partition_to_bundle(
        model, tmp_path / "b", max_stage_bytes=100_000, max_batch_size=1, device_overhead_bytes=0
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
        model, tmp_path / "b", max_stage_bytes=150_000, max_batch_size=4, device_overhead_bytes=0
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
        model, tmp_path / "b", max_stage_bytes=200_000, max_batch_size=1, device_overhead_bytes=0
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
            max_batch_size=1,
            device_overhead_bytes=0,
        )


def test_a_bundle_of_format_2_is_refused_with_the_way_out(tmp_path: Path) -> None:
    partition_to_bundle(demo_recommender(), tmp_path / "b", stages=1)
    path = tmp_path / "b" / "manifest.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"format_version": 2}))
    with pytest.raises(BundleError, match=r"format_version 2.*re-partition the source model"):
        read_manifest(tmp_path / "b")
