"""A table split by rows with the routed combine (issue 42, item 2): each part returns only the
vectors of the ids in its range and their positions, the combine scatters them; the answer is
the dense combine's (and the whole model's) exactly. Real Ray stage actors: the partition test
in tests/shards/partition/test_layer_split.py cuts it into a bundle."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest

from shards.partition.cut import partition_to_bundle
from shards.partition.demo_models import demo_recommender
from shards.split import Split, SplitCombine, TableRows, bounds_for, split_model
from tests.chain import run_chain
from tests.shards.partition.test_layer_split import (
    BUDGET,
    gpt2_inputs,
    partition_gpt2,
    recommender_inputs,
    tiny_gpt2,
    whole,
)


def items_split(parts: int = 3) -> Split:
    return Split("items", "Embedding", "rows", 6000, bounds_for(6000, parts))


def run(model: keras.Model, inputs: dict[str, np.ndarray]) -> np.ndarray:
    return whole(model, inputs)


def test_the_routed_lookup_equals_the_dense_one_and_the_whole_model() -> None:
    model, inputs = demo_recommender(), recommender_inputs(rows=7)
    dense = split_model(model, [items_split()], lookup_combine="dense")
    routed = split_model(model, [items_split()])  # routed: the default since issue 42 item 2
    assert any(isinstance(op, SplitCombine) and op.how == "scatter" for op in routed.layers)
    assert not any(isinstance(op, SplitCombine) and op.how == "scatter" for op in dense.layers)
    expected = run(model, inputs)
    np.testing.assert_array_equal(run(routed, inputs), run(dense, inputs))
    np.testing.assert_array_equal(run(routed, inputs), expected)


def test_a_routed_part_returns_only_its_rows_and_their_positions() -> None:
    table = np.arange(60, dtype="float32").reshape(10, 6)
    part = TableRows(4, 3, 6, 10, routed=True)
    part.build(None)
    part.embeddings.assign(table[4:7])
    ids = np.array([[1, 5, 4], [6, 9, 5]], dtype="int32")
    vectors, positions = (np.asarray(keras.ops.convert_to_numpy(t)) for t in part([ids]))
    # Flat positions 1, 2, 3, 5 hold ids 5, 4, 6, 5: only those rows come back.
    np.testing.assert_array_equal(positions, [1, 2, 3, 5])
    np.testing.assert_array_equal(vectors, table[[5, 4, 6, 5]])


def test_the_scatter_puts_every_part_in_place_exactly() -> None:
    rng = np.random.default_rng(3)
    table = rng.standard_normal((10, 4)).astype("float32")
    ids = rng.integers(0, 10, size=(3, 5)).astype("int32")
    pieces: list[np.ndarray] = []
    for start, stop in ((0, 4), (4, 10)):
        part = TableRows(start, stop - start, 4, 10, routed=True)
        part.build(None)
        part.embeddings.assign(table[start:stop])
        pieces += [np.asarray(keras.ops.convert_to_numpy(t)) for t in part([ids])]
    joined = SplitCombine("scatter")([ids, *pieces])
    np.testing.assert_array_equal(np.asarray(keras.ops.convert_to_numpy(joined)), table[ids])


def test_an_unknown_lookup_combine_is_refused() -> None:
    with pytest.raises(ValueError, match="lookup_combine"):
        split_model(demo_recommender(), [items_split()], lookup_combine="sparse")


def test_a_routed_bundle_answers_as_the_whole_model_and_its_parts_write_their_rows(
    tmp_path: Path,
) -> None:
    model, inputs = demo_recommender(), recommender_inputs()
    manifest = partition_to_bundle(
        model,
        tmp_path / "b",
        max_stage_bytes=BUDGET,
        plan_batch_rows=8,
        device_overhead_bytes=0,
        lookup_combine="routed",
    )
    assert [s.name for s in manifest.stages] == ["0.0", "0.1", "1"]
    # Each part writes, per call, its vectors and their positions (the signature leaves out the
    # leading axis: there the rows it found, not the batch's).
    for stage in manifest.stages[:2]:
        assert [tuple(t.shape) for t in stage.outputs] == [(32,), (), (32,), ()]
    got = run_chain(tmp_path / "b", inputs)["scores"]
    np.testing.assert_array_equal(got, whole(model, inputs))


def test_a_tied_gpt2_routes_its_lookup_and_keeps_its_logits_by_columns(tmp_path: Path) -> None:
    model, inputs = tiny_gpt2(), gpt2_inputs()
    dense = partition_gpt2(model, tmp_path / "dense", lookup_combine="dense")
    routed = partition_gpt2(model, tmp_path / "routed")
    # The lookup's parts write their vectors and positions; the logits' parts are unchanged.
    assert [tuple(t.shape) for t in routed.stages[0].outputs] == [(16,), ()]
    assert [s.name for s in routed.stages] == [s.name for s in dense.stages]
    (got,) = run_chain(tmp_path / "routed", inputs).values()
    (want,) = run_chain(tmp_path / "dense", inputs).values()
    np.testing.assert_array_equal(got, want)
