"""Per-stage weight files: each stage built from its own file holds only its layers, as many
parameters as the plan counts, and computes what the preset's whole backbone does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shards.generation import is_generating_model
from shards.generation.head_merge import slice_bounds
from shards.generation.partition import cut_blocks, head_part_params, stage_params
from shards.generation.preset import extract_tokenizer, read_preset, special_tokens
from shards.generation.stage import StageModel
from shards.generation.weights import build_stage_backbone, head_files, stage_files


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_stages_from_their_files_hold_their_layers_and_compute_the_whole(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    preset: Path = request.getfixturevalue(f"{family}_preset")
    spec = read_preset(str(preset))
    cuts = cut_blocks(spec.num_layers, 3)
    files = stage_files(str(preset), cuts, str(tmp_path / "cache"))
    assert [Path(f).name for f in files] == ["stage-0.npz", "stage-1.npz", "stage-2.npz"]
    # Written once: a second call finds them.
    mtimes = [Path(f).stat().st_mtime_ns for f in files]
    assert stage_files(str(preset), cuts, str(tmp_path / "cache")) == files
    assert [Path(f).stat().st_mtime_ns for f in files] == mtimes
    for cut, file in zip(cuts, files, strict=True):
        backbone = build_stage_backbone(spec, cut.first, cut.last, file)
        assert len(backbone.transformer_layers) == cut.blocks
        assert backbone.count_params() == stage_params(spec, cut, spec.num_layers)

    # Three stages from their files, one step of a prompt: the logits of a stage of the whole
    # preset.
    staged = [
        StageModel(spec, c.first, c.last, 2, 16, weights_file=f)
        for c, f in zip(cuts, files, strict=True)
    ]
    whole = StageModel(spec, 0, spec.num_layers, 2, 16)
    # A row of 3 tokens padded to 4, and a padded row (its slot the scratch one, 2).
    ids = np.array([[5, 6, 7, 0], [0, 0, 0, 0]], np.int32)
    meta = (np.array([0, 2], np.int32), np.array([0, 0], np.int32), np.array([3, 0], np.int32))
    x = ids
    for stage in staged:
        # Attention reads the first 4 positions of each slot: the same as reading all 16.
        x = stage.run(x, *meta, context=4)
    np.testing.assert_allclose(x[0], whole.run(ids, *meta)[0], atol=1e-5)
    # Padded tokens and rows wrote only the scratch slot: slot 1 and slot 0 past 3 are empty.
    for stage in staged:
        cache = stage.cache_array()
        assert cache[:, :, 0, :3].all(axis=(2, 3)).all()
        assert not cache[:, :, 0, 3:].any()
        assert not cache[:, :, 1].any()


def test_a_keras_file_of_a_causal_lm_generates_from_the_same_stage_weights(
    gpt2_keras: Path, gpt2_preset: Path, tmp_path: Path
) -> None:
    assert is_generating_model(str(gpt2_keras))
    spec = read_preset(str(gpt2_keras))
    assert spec.archive and spec.family == "gpt2" and spec.num_layers == 4
    # Its tokenizer is inside the file until extracted, then the preset's own assets.
    assert spec.tokenizer_kind == "byte_bpe" and spec.tokenizer_dir is None
    extracted = extract_tokenizer(spec, tmp_path / "tokenizer")
    assert extracted.tokenizer_dir is not None
    for name in ("vocabulary.json", "merges.txt"):
        ours = (Path(extracted.tokenizer_dir) / name).read_bytes()
        assert ours == (gpt2_preset / "assets" / "tokenizer" / name).read_bytes()
    assert special_tokens(extracted) == special_tokens(read_preset(str(gpt2_preset)))

    cuts = cut_blocks(spec.num_layers, 2)
    from_keras = stage_files(str(gpt2_keras), cuts, str(tmp_path / "a"))
    from_preset = stage_files(str(gpt2_preset), cuts, str(tmp_path / "b"))
    for a, b in zip(from_keras, from_preset, strict=True):
        with np.load(a) as left, np.load(b) as right:
            assert sorted(left.files) == sorted(right.files)
            for key in left.files:
                np.testing.assert_array_equal(left[key], right[key])


def test_a_tied_llama_preset_generates_though_keras_hub_cannot_reload_it(tmp_path: Path) -> None:
    import keras
    import keras_hub

    from tests.generation_models import MARGIN, generate_greedy

    prompts = [(5, 6, 7), (9,)]
    for seed in range(8):
        keras.utils.set_random_seed(seed)
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=64,
            num_layers=2,
            num_query_heads=4,
            num_key_value_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            tie_word_embeddings=True,
        )
        lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
        expected, margin = generate_greedy(lm, prompts, 12)
        if margin >= MARGIN:
            break
    else:
        raise AssertionError("no decisive tied Llama in seeds 0..7")
    preset = tmp_path / "tied"
    lm.save_to_preset(str(preset))
    spec = read_preset(str(preset))
    assert spec.config["tie_word_embeddings"] is True

    cuts = cut_blocks(spec.num_layers, 2)
    files = stage_files(str(preset), cuts, str(tmp_path / "cache"))
    stages = [
        StageModel(spec, c.first, c.last, 2, 12, weights_file=f)
        for c, f in zip(cuts, files, strict=True)
    ]
    assert stages[1].params == stage_params(spec, cuts[1], spec.num_layers)
    for slot, prompt in enumerate(prompts):
        tokens, position = list(prompt), 0
        while len(tokens) < 12:
            new = tokens[position:]
            meta = (np.array([slot], np.int32), np.array([position], np.int32))
            x = np.array([new], np.int32)
            for stage in stages:
                x = stage.run(x, *meta, np.array([len(new)], np.int32))
            position = len(tokens)
            tokens.append(int(np.argmax(x[0])))
        assert tuple(tokens[len(prompt) :]) == expected[slot]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_head_part_files_hold_the_heads_rows_and_give_its_logits(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A head split in 2 (GPT-2's tied table, Llama's own matrix): the parts' rows times the
    last stage's normed hidden states are the whole head's logits."""
    preset: Path = request.getfixturevalue(f"{family}_preset")
    spec = read_preset(str(preset))
    files = head_files(str(preset), 2, str(tmp_path / "cache"))
    assert head_files(str(preset), 2, str(tmp_path / "cache")) == files  # written once
    parts = [np.load(f) for f in files]
    bounds = slice_bounds(spec.vocabulary_size, 2)
    assert [(int(p["offset"]), int(p["offset"]) + p["kernel"].shape[0]) for p in parts] == bounds
    assert [p["kernel"].size for p in parts] == head_part_params(spec, 2)
    cuts = cut_blocks(spec.num_layers, 2)
    stage = stage_files(str(preset), cuts, str(tmp_path / "cache"))
    first = StageModel(spec, 0, cuts[0].last, 2, 16, weights_file=stage[0])
    headless = StageModel(spec, cuts[1].first, cuts[1].last, 2, 16, stage[1], head=False)
    whole = StageModel(spec, cuts[1].first, cuts[1].last, 2, 16, stage[1])
    assert headless.params == stage_params(spec, cuts[1], spec.num_layers, head=False)
    one = np.zeros((1,), np.int32)
    step = (one, one, one + 4, 16)
    h = first.run(np.array([[5, 6, 7, 8]], np.int32), *step)
    normed = headless.run(h, *step)
    logits = np.concatenate([normed @ p["kernel"].T for p in parts], axis=1)
    np.testing.assert_allclose(logits, whole.run(h, *step), atol=1e-5, rtol=0)
