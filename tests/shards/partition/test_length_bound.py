"""A model's own longest input (issue 27, item 2): keras_hub backbones of 32 and 64 positions
built in code (small dims, nothing downloaded) are planned, warmed and described at their
bound; a length asked for over it is refused with both numbers, one under it is planned at;
a layer that declares its length only through its config, and one that declares nothing (the
probe), are bounded too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import keras_hub
import numpy as np
import pytest

from shards.bundle.format import read_manifest
from shards.errors import PartitionError
from shards.partition.cut import partition_to_bundle
from shards.partition.graph import analyse
from shards.partition.stages import plan_stages
from tests.chain import run_chain

SMALL: dict[str, Any] = {
    "vocabulary_size": 100,
    "num_layers": 1,
    "num_heads": 2,
    "hidden_dim": 16,
    "intermediate_dim": 32,
}
BACKBONES: dict[str, Callable[..., keras.Model]] = {
    "bert": keras_hub.models.BertBackbone,
    "gpt2": keras_hub.models.GPT2Backbone,
    "roberta": keras_hub.models.RobertaBackbone,
}


@pytest.mark.parametrize("positions", [32, 64])
@pytest.mark.parametrize("kind", sorted(BACKBONES))
def test_a_backbone_is_planned_at_its_position_embeddings_rows(kind: str, positions: int) -> None:
    model = BACKBONES[kind](max_sequence_length=positions, **SMALL)
    graph = analyse(model)  # no length asked for: the model's own
    assert graph.sequence_length == positions
    bounds = {t.name: t.max_length for t in graph.signature.inputs}
    assert bounds["token_ids"] == positions
    assert graph.signature.max_length == positions
    (stage,) = (spec for _, spec in plan_stages(graph, stages=1, device_overhead_bytes=0))
    assert stage.memory is not None and stage.memory.unknown_dims
    assert stage.memory.sequence_length == positions


@pytest.mark.parametrize("kind", sorted(BACKBONES))
def test_a_length_over_the_bound_is_refused_with_both_numbers(kind: str) -> None:
    model = BACKBONES[kind](max_sequence_length=32, **SMALL)
    with pytest.raises(PartitionError) as info:
        analyse(model, 512)
    message = str(info.value)
    assert "max_sequence_length=512 is over 32, the longest input this model takes" in message
    assert "PositionEmbedding) has 32 positions" in message  # the layer that says so
    assert "--max-sequence-length at most 32" in message


def test_a_length_under_the_bound_is_planned_at(tmp_path: Path) -> None:
    model = BACKBONES["bert"](max_sequence_length=64, **SMALL)
    manifest = partition_to_bundle(model, tmp_path / "b", stages=2, max_sequence_length=16)
    assert {s.memory.sequence_length for s in manifest.stages if s.memory} == {16}
    # The model's bound stays what the model takes, whatever length this bundle was planned at.
    assert manifest.signature.max_length == 64


def test_the_bound_travels_in_the_manifest_and_the_stages_run_at_it(tmp_path: Path) -> None:
    """The BERT of the issue (3 inputs, masks crossing the cut): planned at 32, not 512, and
    its two stages run a batch as long as that."""
    model = BACKBONES["bert"](max_sequence_length=32, **SMALL)
    partition_to_bundle(model, tmp_path / "b", stages=2)
    manifest = read_manifest(tmp_path / "b")
    assert manifest.signature.max_length == 32
    assert [s.memory.sequence_length for s in manifest.stages if s.memory] == [32, 32]
    batch = {
        "token_ids": np.ones((2, 32), "int32"),
        "segment_ids": np.zeros((2, 32), "int32"),
        "padding_mask": np.ones((2, 32), "int32"),
    }
    got = run_chain(tmp_path / "b", batch)
    want = model(batch, training=False)
    np.testing.assert_allclose(
        got["sequence_output"], keras.ops.convert_to_numpy(want["sequence_output"]), atol=1e-5
    )


class Positions(keras.layers.Layer):
    """One weight row per position, the length named in the config (keras.io's ``maxlen``)."""

    def __init__(self, maxlen: int, width: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.maxlen, self.width = maxlen, width

    def build(self, input_shape: Any) -> None:
        self.table = self.add_weight(shape=(self.maxlen, self.width), name="table")

    def call(self, x: Any) -> Any:
        return x + self.table[: keras.ops.shape(x)[1]][None]

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "maxlen": self.maxlen, "width": self.width}


class Unsaid(Positions):
    """The same table, its length said nowhere in the config."""

    def get_config(self) -> dict[str, Any]:
        return {**keras.layers.Layer.get_config(self), "width": self.width}


def _tokens_model(positions: keras.layers.Layer) -> keras.Model:
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    flags = keras.Input((None,), dtype="int32", name="flags")  # not read by the positions
    x = positions(keras.layers.Embedding(20, 4, name="emb")(tokens))
    y = keras.layers.Embedding(2, 4, name="flag_emb")(flags)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(keras.layers.Add()([x, y]))
    return keras.Model([tokens, flags], keras.layers.Dense(2, name="out")(pooled))


def test_a_config_length_equal_to_a_weights_rows_bounds_the_inputs_it_reads() -> None:
    graph = analyse(_tokens_model(Positions(24, 4, name="pos")))
    assert graph.sequence_length == 24
    bounds = {t.name: t.max_length for t in graph.signature.inputs}
    assert bounds == {"tokens": 24, "flags": None}
    with pytest.raises(PartitionError, match=r"layer 'pos' \(Positions\) has 24 positions"):
        analyse(_tokens_model(Positions(24, 4, name="pos")), 25)


def test_where_no_layer_says_a_probe_finds_the_longest_that_runs() -> None:
    graph = analyse(_tokens_model(Unsaid(24, 4, name="pos")))
    assert graph.sequence_length == 24
    # The probe cannot tell which input a failure came from: it bounds every input of
    # unknown length.
    assert {t.name: t.max_length for t in graph.signature.inputs} == {"tokens": 24, "flags": 24}
    with pytest.raises(PartitionError, match="runs one row of length 24 and fails at 25"):
        analyse(_tokens_model(Unsaid(24, 4, name="pos")), 100)


def test_a_model_that_runs_at_every_length_has_no_bound() -> None:
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(tokens))
    graph = analyse(keras.Model(tokens, pooled))
    assert graph.signature.max_length is None
    assert graph.sequence_length == 512  # the default, as before
    assert analyse(keras.Model(tokens, pooled), 2048).sequence_length == 2048
