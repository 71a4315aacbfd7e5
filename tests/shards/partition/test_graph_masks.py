"""Implicit Keras masks cross cuts as tensors of their own and are attached again after."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import keras
import numpy as np
import pytest

from shards.bundle.format import read_manifest
from shards.partition.cut import partition_to_bundle
from shards.partition.graph import analyse
from shards.pipeline.replica_set import PipelineOptions, ReplicaSet
from tests.chain import run_chain
from tests.shards.model_zoo import Inputs, call_whole

TOLERANCE = 1e-4
SEQ = 7
# Rows padded with 0 (the masked token) to different lengths.
TOKENS = np.array(
    [[3, 9, 4, 0, 0, 0, 0], [5, 1, 0, 0, 0, 0, 0], [2, 2, 7, 8, 6, 1, 9]], dtype="int32"
)


def _embedded(mask_zero: bool) -> tuple[keras.KerasTensor, keras.KerasTensor]:
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    return tokens, keras.layers.Embedding(12, 8, mask_zero=mask_zero, name="emb")(tokens)


def lstm_model(mask_zero: bool = True) -> keras.Model:
    keras.utils.set_random_seed(11)
    tokens, x = _embedded(mask_zero)
    x = keras.layers.LSTM(6, return_sequences=True, name="lstm_a")(x)
    x = keras.layers.LSTM(5, name="lstm_b")(x)
    return keras.Model(tokens, keras.layers.Dense(3, name="out")(x), name="lstm")


def attention_model(mask_zero: bool = True) -> keras.Model:
    keras.utils.set_random_seed(12)
    tokens, x = _embedded(mask_zero)
    att = keras.layers.MultiHeadAttention(2, 4, name="att")(x, x)
    x = keras.layers.LayerNormalization(name="norm")(keras.layers.Add(name="res")([x, att]))
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(tokens, keras.layers.Dense(3, name="out")(x), name="attention")


def nested_blocks_model(mask_zero: bool = True) -> keras.Model:
    """A transformer block nested as a model and called twice: at run time its attention drops
    the masks of its inputs, so the residual sum and everything after it carry none."""
    keras.utils.set_random_seed(13)
    block_in = keras.Input((SEQ, 8))
    att = keras.layers.MultiHeadAttention(2, 4, name="block_att")(block_in, block_in)
    block_out = keras.layers.LayerNormalization(name="block_norm")(
        keras.layers.Add(name="block_res")([block_in, att])
    )
    block = keras.Model(block_in, block_out, name="block")
    tokens, x = _embedded(mask_zero)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(block(block(x)))
    return keras.Model(tokens, keras.layers.Dense(3, name="out")(x), name="blocks")


MODELS: dict[str, Callable[..., keras.Model]] = {
    "lstm": lstm_model,
    "attention": attention_model,
    "nested_blocks": nested_blocks_model,
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_cut_after_the_embedding_matches_the_whole(kind: str, tmp_path: Path) -> None:
    model = MODELS[kind]()
    inputs: Inputs = {"tokens": TOKENS}
    want = call_whole(model, inputs)["out"]
    # The mask changes the answer: without it the padded positions count.
    unmasked = MODELS[kind](mask_zero=False)
    unmasked.set_weights(model.get_weights())
    assert float(np.max(np.abs(call_whole(unmasked, inputs)["out"] - want))) > 1e-3

    n = len(analyse(model).nodes)
    manifest = partition_to_bundle(model, tmp_path / "b", stages=n)  # a cut after every node
    assert [t.name for t in manifest.stages[0].outputs] == ["emb"]
    # Each stage that receives the embedding (or a tensor masked like it) receives the mask.
    masked_inputs = [
        s for s in manifest.stages if s.index > 0 and "emb" in [t.name for t in s.inputs]
    ]
    assert masked_inputs
    for stage in masked_inputs:
        (mask,) = [t for t in stage.inputs if t.dtype == "bool"]
        assert mask.shape == (SEQ,)
    got = run_chain(tmp_path / "b", inputs)["out"]
    assert float(np.max(np.abs(got - want))) <= TOLERANCE


@pytest.mark.parametrize("stages", [2, 3])
def test_balanced_cuts_of_the_attention_model_match(stages: int, tmp_path: Path) -> None:
    model = attention_model()
    partition_to_bundle(model, tmp_path / "b", stages=stages)
    got = run_chain(tmp_path / "b", {"tokens": TOKENS})["out"]
    want = call_whole(model, {"tokens": TOKENS})["out"]
    assert float(np.max(np.abs(got - want))) <= TOLERANCE


async def test_mask_crosses_shard_actors(ray_address: str, tmp_path: Path) -> None:
    model = attention_model()
    nodes = [n.name for n in analyse(model).nodes]
    partition_to_bundle(model, tmp_path / "b", stages=3)
    assert len(read_manifest(tmp_path / "b").stages) == 3 <= len(nodes)
    group = await ReplicaSet.create(
        tmp_path / "b", PipelineOptions(batch_sizes=(3,), cpus_per_shard=0.5)
    )
    try:
        out = await group.run({"tokens": TOKENS})
    finally:
        await group.close()
    want = call_whole(model, {"tokens": TOKENS})["out"]
    np.testing.assert_allclose(out["out"], want, atol=TOLERANCE, rtol=0)
