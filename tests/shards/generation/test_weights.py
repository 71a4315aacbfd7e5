"""Per-stage weight files: each stage built from its own file holds only its layers, as many
parameters as the plan counts, and computes what the preset's whole backbone does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shards.generation.partition import cut_blocks, stage_params
from shards.generation.preset import read_preset
from shards.generation.stage import StageModel
from shards.generation.weights import build_stage_backbone, stage_files


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

    # Three stages from their files, one step of a prompt: the logits of a whole preset's stage.
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
        x = stage.run(x, *meta)
    np.testing.assert_allclose(x[0], whole.run(ids, *meta)[0], atol=1e-5)
    # Padded tokens and rows wrote only the scratch slot: slot 1 and slot 0 past 3 are empty.
    for stage in staged:
        cache = np.asarray(stage.cache)
        assert cache[:, :, 0, :3].all(axis=(2, 3)).all()
        assert not cache[:, :, 0, 3:].any()
        assert not cache[:, :, 1].any()
