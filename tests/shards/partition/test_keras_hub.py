"""A keras_hub BERT encoder built in code (random weights, nothing downloaded) cuts in two stages
that match the whole model on a padded batch, and its padding mask and same-length inputs are
marked for length padding."""

from __future__ import annotations

from pathlib import Path

import keras
import keras_hub
import numpy as np
import pytest

from shards.bundle.format import Manifest
from shards.partition.cut import partition_to_bundle
from tests.chain import run_chain

TOLERANCE = 1e-5
LENGTHS = (20, 11, 3)  # each row's real length; the batch is padded to the longest


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[keras.Model, Path, Manifest]:
    keras.utils.set_random_seed(19)
    model = keras_hub.models.BertBackbone(
        vocabulary_size=1000,
        num_layers=2,
        num_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
        max_sequence_length=128,
    )
    out = tmp_path_factory.mktemp("bert") / "bundle"
    manifest = partition_to_bundle(model, out, stages=2, max_sequence_length=128)
    return model, out, manifest


def padded_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    longest = max(LENGTHS)
    mask = np.arange(longest)[None, :] < np.array(LENGTHS)[:, None]
    tokens = np.where(mask, rng.integers(1, 1000, size=(len(LENGTHS), longest)), 0)
    segments = np.where(mask & (np.arange(longest) >= 2), 1, 0)
    return {
        "token_ids": tokens.astype("int32"),
        "segment_ids": segments.astype("int32"),
        "padding_mask": mask.astype("int32"),
    }


def whole(model: keras.Model, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: keras.ops.convert_to_numpy(v) for k, v in model(inputs, training=False).items()}


def test_the_encoder_cuts_in_two_stages_that_match_the_whole(
    bert: tuple[keras.Model, Path, Manifest],
) -> None:
    model, bundle, manifest = bert
    assert len(manifest.stages) == 2
    # The second stage's transformer layers read the padding mask from the request.
    assert "padding_mask" in [t.name for t in manifest.stages[1].inputs]
    batch = padded_batch()
    got, want = run_chain(bundle, batch), whole(model, batch)
    assert sorted(got) == ["pooled_output", "sequence_output"]
    for name in got:
        np.testing.assert_allclose(got[name], want[name], atol=TOLERANCE, rtol=0)
    # Under the mask a padded row answers as it does alone at its own length.
    length = LENGTHS[1]
    alone = whole(model, {k: v[1:2, :length] for k, v in batch.items()})
    np.testing.assert_allclose(want["pooled_output"][1:2], alone["pooled_output"], atol=1e-4)
    np.testing.assert_allclose(
        want["sequence_output"][1:2, :length], alone["sequence_output"], atol=1e-4
    )


def test_the_padding_mask_and_the_ids_beside_it_pad_with_zero(
    bert: tuple[keras.Model, Path, Manifest],
) -> None:
    pads = {t.name: t.pad_value for t in bert[2].signature.inputs}
    assert pads == {"padding_mask": 0, "segment_ids": 0, "token_ids": 0}
