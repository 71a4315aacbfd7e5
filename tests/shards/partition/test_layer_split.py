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

from shards.bundle.format import BundleError, Manifest, load_stage, read_manifest
from shards.partition.cut import partition_to_bundle
from shards.partition.demo_models import demo_recommender
from shards.partition.plan import PlanError
from shards.split import hold_rows_once
from tests.chain import run_chain

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
    # Held once (the default): part k's logits run in part k's lookup actor, from its rows; the
    # actor's plan is its rows once and both uses' activations, within the budget.
    assert [p["held_by"] for p in logits["stages"]] == [0, 1]
    assert (manifest.hosts, manifest.actors, manifest.depth) == ([0, 1, 2, 0, 1], 3, 3)
    assert manifest.actor_peak_bytes(0) == 160_000 + 576 + 80_512 <= 400_000
    # The logits are a column slice of a matrix product: 1e-6 relative.
    (got,) = run_chain(tmp_path / "b", inputs).values()
    want = keras.ops.convert_to_numpy(model(inputs))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # In one process the logits part reads the lookup part's rows: one variable, its own copy
    # dropped, the same logits.
    host, guest = (load_stage(tmp_path / "b", i, ["keras_hub"]) for i in (0, 3))
    hidden = np.random.default_rng(5).normal(size=(2, 8, 16)).astype("float32")
    before = keras.ops.convert_to_numpy(guest(hidden))
    assert hold_rows_once(guest, host) == 160_000
    (rows,) = host.weights
    assert [id(w) for w in guest.weights] == [id(rows)]
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(guest(hidden)), before)
    # Held twice (as before issue 42): the same stages, an actor each.
    twice = partition_gpt2(model, tmp_path / "twice", tied_tables="twice")
    assert [s.name for s in twice.stages] == [s.name for s in manifest.stages]
    assert (twice.hosts, twice.actors, twice.depth) == ([0, 1, 2, 3, 4], 5, 3)


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


# The MLP below: fc1 256 -> 2048 (2 MiB) and fc2 2048 -> 256 (2 MiB), each over the budget.
MLP_BUDGET = 1_500_000


def mlp(head_activation: str | None = "softmax") -> keras.Model:
    """x -> fc1 (gelu) -> dropout -> relu -> fc2 (tanh) -> head: two Dense layers too large for
    one device with only elementwise layers between them (issue 42)."""
    keras.utils.set_random_seed(7)
    x = keras.Input((256,), name="x")
    h = keras.layers.Dense(2048, activation="gelu", name="fc1")(x)
    h = keras.layers.Dropout(0.1, name="drop")(h)
    h = keras.layers.Activation("relu", name="act")(h)
    y = keras.layers.Dense(256, activation="tanh", name="fc2")(h)
    out = keras.layers.Dense(8, activation=head_activation, name="head")(y)
    return keras.Model(x, out, name="mlp")


def mlp_inputs(rows: int = 5) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(3).normal(size=(rows, 256)).astype("float32")}


def partition_mlp(model: keras.Model, out: Path) -> Manifest:
    return partition_to_bundle(
        model, out, max_stage_bytes=MLP_BUDGET, plan_batch_rows=4, device_overhead_bytes=0
    )


def test_a_column_split_dense_feeding_a_dense_pairs_with_it_in_one_place(tmp_path: Path) -> None:
    model, inputs = mlp(), mlp_inputs()
    manifest = partition_mlp(model, tmp_path / "b")
    # fc1's output units and fc2's input units split at the same bounds: part k holds both
    # slices and sends only its partial sum. Two places, not four (fc1's parts, a stage that
    # only joins, fc2's parts, the head). Each part holds a third of both layers (1.4 MB).
    assert [s.name for s in manifest.stages] == ["0.0", "0.1", "0.2", "1"]
    assert manifest.depth == 2
    (split,) = manifest.splits()
    assert (split["layer"], split["kind"], split["how"], split["parts"]) == (
        "fc1",
        "Dense+Dense",
        "pair",
        3,
    )
    bounds = [(p["start"], p["stop"]) for p in split["stages"]]
    assert bounds == [(0, 682), (682, 1365), (1365, 2048)]
    assert all(s.planned_peak_bytes <= MLP_BUDGET for s in manifest.stages)
    # What crosses from a part is fc2's width (256), not fc1's slice of the hidden units.
    assert [t.shape for t in manifest.stages[0].outputs] == [(256,)]
    # A sum of partial products reorders fc2's additions: 1e-5 relative.
    got = run_chain(tmp_path / "b", inputs)["head"]
    np.testing.assert_allclose(got, whole(model, inputs), rtol=1e-5, atol=1e-7)


def test_without_pairs_each_dense_is_split_by_columns_alone(tmp_path: Path) -> None:
    # pair_dense=False (the split bench's "unpaired" layout): fc1's parts, a stage that only
    # joins the hidden units, fc2's parts, the head: four places; answers within 1e-6.
    model, inputs = mlp(), mlp_inputs()
    manifest = partition_to_bundle(
        model,
        tmp_path / "b",
        max_stage_bytes=MLP_BUDGET,
        plan_batch_rows=4,
        device_overhead_bytes=0,
        pair_dense=False,
    )
    assert [(s["layer"], s["how"]) for s in manifest.splits()] == [
        ("fc1", "columns"),
        ("fc2", "columns"),
    ]
    assert manifest.depth == 4
    got = run_chain(tmp_path / "b", inputs)["head"]
    np.testing.assert_allclose(got, whole(model, inputs), rtol=1e-5, atol=1e-7)


def test_a_paired_output_is_summed_by_the_driver(tmp_path: Path) -> None:
    # fc2 linear and the model's output: the driver sums the parts' partial products (the bias
    # held by part 0 alone, so added once); one place in the pipeline.
    keras.utils.set_random_seed(8)
    x = keras.Input((256,), name="x")
    h = keras.layers.Dense(2048, activation="relu", name="fc1")(x)
    model = keras.Model(x, keras.layers.Dense(256, name="fc2")(h), name="mlp2")
    manifest = partition_mlp(model, tmp_path / "b")
    assert [s.name for s in manifest.stages] == ["0.0", "0.1", "0.2"]
    (combine,) = manifest.combines
    assert (combine.output, combine.how) == ("fc2", "add")
    inputs = mlp_inputs()
    got = run_chain(tmp_path / "b", inputs)["fc2"]
    np.testing.assert_allclose(got, whole(model, inputs), rtol=1e-5, atol=1e-6)


def untied_table() -> keras.Model:
    import keras_hub

    keras.utils.set_random_seed(5)
    ids = keras.Input((4,), dtype="int32", name="ids")
    table = keras_hub.layers.ReversibleEmbedding(8000, 32, tie_weights=False, name="table")
    x = table(ids)
    x = keras.layers.Dense(32, activation="relu", name="mix")(x)
    return keras.Model(ids, table(x, reverse=True), name="untied")


def test_an_untied_table_charges_each_use_its_own_matrix(tmp_path: Path) -> None:
    # Each matrix is 8000 x 32 x 4 = 1 024 000 bytes; the budget holds half of one and its
    # logits at batch 2. Charged
    # both matrices per use, each use came out in 4 parts; its own matrix: 2 + 2.
    model = untied_table()
    manifest = partition_to_bundle(
        model, tmp_path / "b", max_stage_bytes=700_000, plan_batch_rows=2, device_overhead_bytes=0
    )
    lookup, logits = manifest.splits()
    assert (lookup["use"], lookup["parts"], logits["use"], logits["parts"]) == (
        None,
        2,
        "logits",
        2,
    )
    assert [p["weight_bytes"] for s in (lookup, logits) for p in s["stages"]] == [512_000] * 4
    rows = np.array([[1, 7999, 4000, 0], [3, 2, 1, 5]], dtype="int32")
    (got,) = run_chain(tmp_path / "b", {"ids": rows}).values()
    want = keras.ops.convert_to_numpy(model(rows))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["Dense", "Embedding"])
def test_a_quantized_layer_too_large_is_refused_at_plan_time_by_name(
    tmp_path: Path, kind: str
) -> None:
    if kind == "Dense":
        x = keras.Input((256,), name="x")
        layer: keras.layers.Layer = keras.layers.Dense(4096, name="big")
        model = keras.Model(x, layer(x))
    else:
        x = keras.Input((4,), dtype="int32", name="x")
        layer = keras.layers.Embedding(20_000, 64, name="big")
        model = keras.Model(x, layer(x))
    model.quantize("int8")
    assert layer.quantization_mode == "int8"
    with pytest.raises(PlanError, match=rf"layer 'big' \({kind}\) is quantized \(int8\)"):
        partition_to_bundle(
            model,
            tmp_path / "b",
            max_stage_bytes=200_000,
            plan_batch_rows=2,
            device_overhead_bytes=0,
        )
    assert not (tmp_path / "b" / "manifest.json").exists()
