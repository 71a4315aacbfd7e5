"""A masked token model whose length is unknown (``Input((None,))``) cuts into stages that match
the whole at every length, rows zero-padded, in process and through shard actors."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest

from shards.partition.cut import partition_to_bundle
from shards.partition.graph import analyse
from shards.pipeline.replica_set import PipelineOptions, ReplicaSet
from tests.chain import run_chain
from tests.shards.model_zoo import call_whole

TOLERANCE = 1e-5


def token_model() -> keras.Model:
    keras.utils.set_random_seed(21)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(100, 16, mask_zero=True, name="emb")(tokens)
    x = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(tokens, keras.layers.Dense(4, name="out")(x), name="tokens_model")


def padded_rows(length: int) -> np.ndarray:
    """Three rows of ``length`` tokens: one full, two ending in zeros (the masked token)."""
    rows = np.random.default_rng(length).integers(1, 100, size=(3, length), dtype="int32")
    rows[1, max(1, length // 2) :] = 0
    rows[2, 1:] = 0
    return rows


def test_the_mask_changes_the_answer() -> None:
    model = token_model()
    rows = padded_rows(9)
    # A row padded further answers the same; without the mask it would not.
    longer = np.concatenate([rows, np.zeros((3, 4), "int32")], axis=1)
    whole = call_whole(model, {"tokens": rows})["out"]
    np.testing.assert_allclose(
        call_whole(model, {"tokens": longer})["out"], whole, atol=TOLERANCE, rtol=0
    )
    assert analyse(model).signature.inputs[0].shape == (None,)


@pytest.mark.parametrize("stages", [2, 3])
def test_unknown_length_cuts_match_the_whole_at_every_length(stages: int, tmp_path: Path) -> None:
    model = token_model()
    manifest = partition_to_bundle(model, tmp_path / "b", stages=stages)
    assert len(manifest.stages) == stages
    for length in (1, 5, 17):
        inputs = {"tokens": padded_rows(length)}
        got = run_chain(tmp_path / "b", inputs)["out"]
        want = call_whole(model, inputs)["out"]
        assert float(np.max(np.abs(got - want))) <= TOLERANCE, length


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_every_cut_of_a_reloaded_model_matches(stages: int, tmp_path: Path) -> None:
    """From a ``.keras`` file in a fresh process, as ``shardserve partition`` cuts it: the
    loaded Embedding makes its mask op again under the saved mask op's own name."""
    model = token_model()
    model.save(tmp_path / "tokens.keras")
    keras.backend.clear_session()  # Keras's name counters as a fresh process has them
    partition_to_bundle(tmp_path / "tokens.keras", tmp_path / "b", stages=stages)
    for length in (5, 17):
        inputs = {"tokens": padded_rows(length)}
        got = run_chain(tmp_path / "b", inputs)["out"]
        want = call_whole(model, inputs)["out"]
        assert float(np.max(np.abs(got - want))) <= TOLERANCE, length


async def test_unknown_length_crosses_shard_actors(ray_address: str, tmp_path: Path) -> None:
    model = token_model()
    model.save(tmp_path / "tokens.keras")
    keras.backend.clear_session()
    partition_to_bundle(tmp_path / "tokens.keras", tmp_path / "b", stages=2)
    group = await ReplicaSet.create(
        tmp_path / "b", PipelineOptions(batch_sizes=(3,), cpus_per_shard=0.5)
    )
    try:
        for length in (5, 17):
            inputs = {"tokens": padded_rows(length)}
            out = await group.run(inputs)
            want = call_whole(model, inputs)["out"]
            np.testing.assert_allclose(out["out"], want, atol=TOLERANCE, rtol=0)
        stats = await group.stats()
    finally:
        await group.close()
    # Each stage keeps its compute per (rows, length) shape for the server's cost model.
    for stage in stats:
        assert {"3,5", "3,17"} <= set(stage["compute_by_shape"])
        assert stage["shapes_run"] == len(stage["compute_by_shape"])


def test_layers_over_positions_are_costed_at_the_sequence_length() -> None:
    model = token_model()
    short = {n.name: n.cost.flops_per_row for n in analyse(model, 8).nodes}
    long = {n.name: n.cost.flops_per_row for n in analyse(model, 64).nodes}
    # A Dense over every position: 8x the positions, 8x the work; after pooling, the same.
    assert long["hidden"] == 8 * short["hidden"] > 0
    assert long["out"] == short["out"]
