"""Cutting real (tiny) Keras models: stages chained through files match the whole model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import keras
import numpy as np
import pytest

from shards.bundle.format import read_manifest
from shards.partition.cut import partition_to_bundle
from shards.partition.graph import PartitionError, analyse
from shards.partition.plan import PlanError
from tests.chain import run_chain
from tests.shards.model_zoo import ZOO, call_whole, multi_io, residual, sequential

TOLERANCE = 1e-5


def assert_chain_matches(model: keras.Model, inputs: dict[str, np.ndarray], bundle: Path) -> None:
    want = call_whole(model, inputs)
    got = run_chain(bundle, inputs)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].shape == value.shape
        assert float(np.max(np.abs(got[name] - value))) <= TOLERANCE, name


@pytest.mark.parametrize("kind", sorted(ZOO))
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_chained_stages_match_whole_model(kind: str, stages: int, tmp_path: Path) -> None:
    model, inputs = ZOO[kind]()
    manifest = partition_to_bundle(model, tmp_path / "b", stages=stages)
    assert len(manifest.stages) == stages
    assert_chain_matches(model, inputs, tmp_path / "b")


def test_every_single_node_cut_of_the_residual_model_matches(tmp_path: Path) -> None:
    model, inputs = residual()
    n = len(analyse(model).nodes)
    manifest = partition_to_bundle(model, tmp_path / "b", stages=n)
    # One stage per node: the add of each block receives both the skip and the branch.
    assert max(len(s.inputs) for s in manifest.stages) == 2
    assert_chain_matches(model, inputs, tmp_path / "b")


def test_cut_inside_a_residual_block_carries_two_tensors(tmp_path: Path) -> None:
    model, inputs = residual()
    manifest = partition_to_bundle(model, tmp_path / "b", stages=2)
    assert [len(s.inputs) for s in manifest.stages] == [1, 2]
    assert_chain_matches(model, inputs, tmp_path / "b")


def test_attention_mask_is_routed_around_stages_not_through_them(tmp_path: Path) -> None:
    model, inputs = ZOO["encoder"]()
    manifest = partition_to_bundle(model, tmp_path / "b", stages=4)
    takes_mask = [s.index for s in manifest.stages if "mask" in [t.name for t in s.inputs]]
    assert len(takes_mask) >= 3  # every stage holding an attention layer, not just stage 0
    assert all("mask" not in [t.name for t in s.outputs] for s in manifest.stages)
    # Those later stages take the mask straight from the model inputs plus the running state.
    assert all(len(manifest.stages[i].inputs) >= 2 for i in takes_mask[1:])
    assert_chain_matches(model, inputs, tmp_path / "b")


def test_dict_outputs_keep_the_model_names(tmp_path: Path) -> None:
    model, _ = multi_io()
    manifest = partition_to_bundle(model, tmp_path / "b", stages=3)
    assert manifest.signature.input_names == ["a", "b"]
    assert sorted(manifest.signature.output_names) == ["klass", "score"]
    assert {t.name for t in manifest.stages[-1].outputs} >= {"klass", "score"}


def test_tensor_names_are_unique_within_the_bundle(tmp_path: Path) -> None:
    model, _ = ZOO["reuse"]()
    manifest = partition_to_bundle(model, tmp_path / "b", stages=5)
    outputs = [t.name for s in manifest.stages for t in s.outputs]
    assert len(outputs) == len(set(outputs))
    assert outputs[-1] == "out"


def test_sequential_signature(tmp_path: Path) -> None:
    model, _ = sequential()
    manifest = partition_to_bundle(model, tmp_path / "b", stages=2, source_name="demo:x")
    assert manifest.signature.inputs[0].name == "features"
    assert manifest.signature.inputs[0].shape == (8,)
    assert manifest.signature.outputs[0].shape == (4,)
    assert manifest.source == "demo:x"
    assert [s.file for s in manifest.stages] == ["stage_000.keras", "stage_001.keras"]
    assert all((tmp_path / "b" / s.file).is_file() for s in manifest.stages)
    assert read_manifest(tmp_path / "b") == manifest


def test_budget_gives_fewest_stages_that_fit(tmp_path: Path) -> None:
    model, inputs = sequential()
    # Weights: 8x16+16, 16x16+16, 16x8+8, 8x4+4 floats = 576, 1088, 544, 144 bytes; at one
    # row and no device overhead the activations add under 200 bytes a stage.
    manifest = partition_to_bundle(
        model, tmp_path / "b", max_stage_bytes=1900, plan_batch_rows=1, device_overhead_bytes=0
    )
    assert len(manifest.stages) == 2
    assert all(s.planned_peak_bytes <= 1900 for s in manifest.stages)
    assert sum(s.param_bytes for s in manifest.stages) == 576 + 1088 + 544 + 144
    assert_chain_matches(model, inputs, tmp_path / "b")


def test_budget_smaller_than_a_layer_splits_it(tmp_path: Path) -> None:
    # Issue 29: a Dense larger than the budget is split by its output units, not refused (the
    # refusal of a kind that cannot be split: tests/shards/partition/test_layer_split.py).
    model, inputs = sequential()
    manifest = partition_to_bundle(
        model, tmp_path / "b", max_stage_bytes=1000, plan_batch_rows=1, device_overhead_bytes=0
    )
    assert {s.part.layer for s in manifest.stages if s.part} == {model.layers[1].name}
    assert all(s.planned_peak_bytes <= 1000 for s in manifest.stages)
    assert_chain_matches(model, inputs, tmp_path / "b")


def test_more_stages_than_nodes_is_an_error(tmp_path: Path) -> None:
    model, _ = sequential()
    with pytest.raises(PlanError, match=r"stages=9 is more than the model's 4 cuttable nodes"):
        partition_to_bundle(model, tmp_path / "b", stages=9)


def test_stages_and_budget_together_is_an_error(tmp_path: Path) -> None:
    model, _ = sequential()
    with pytest.raises(PartitionError, match="not both"):
        partition_to_bundle(model, tmp_path / "b", stages=2, max_stage_bytes=10_000)


def test_non_empty_output_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("keep me")
    model, _ = sequential()
    with pytest.raises(PartitionError, match="exists and is not empty"):
        partition_to_bundle(model, tmp_path / "b")


def test_keras_file_source(tmp_path: Path) -> None:
    model, inputs = multi_io()
    path = tmp_path / "multi.keras"
    model.save(path)
    messages: list[str] = []
    manifest = partition_to_bundle(path, tmp_path / "b", stages=2, progress=messages.append)
    assert manifest.source == "multi.keras"
    assert manifest.source_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert any("stage 1" in m for m in messages)
    assert_chain_matches(model, inputs, tmp_path / "b")


def test_unknown_source_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "model.h5").write_bytes(b"")
    with pytest.raises(PartitionError, match=r"not a .keras file or a SavedModel"):
        partition_to_bundle(tmp_path / "model.h5", tmp_path / "b")


def test_subclassed_model_is_refused(tmp_path: Path) -> None:
    class Custom(keras.Model):
        def call(self, x: object) -> object:
            return x

    with pytest.raises(PartitionError, match="subclassed Custom"):
        partition_to_bundle(Custom(), tmp_path / "b")


def test_savedmodel_is_served_as_one_stage(tmp_path: Path) -> None:
    model, inputs = sequential()
    model.export(str(tmp_path / "sm"), verbose=False)
    manifest = partition_to_bundle(tmp_path / "sm", tmp_path / "b")
    assert len(manifest.stages) == 1
    assert manifest.stages[0].file.endswith(".savedmodel")
    assert manifest.signature.input_names == ["features"]
    want = call_whole(model, inputs)
    got = run_chain(tmp_path / "b", inputs)
    (name,) = manifest.signature.output_names
    assert float(np.max(np.abs(got[name] - next(iter(want.values()))))) <= TOLERANCE


def test_savedmodel_cannot_be_sharded(tmp_path: Path) -> None:
    model, _ = sequential()
    model.export(str(tmp_path / "sm"), verbose=False)
    with pytest.raises(PartitionError, match=r"TF SavedModel.*cannot be sharded.*stages=2"):
        partition_to_bundle(tmp_path / "sm", tmp_path / "b", stages=2)
