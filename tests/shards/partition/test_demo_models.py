"""Demo models: names, signatures, and the same weights on every build in any process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from shards.bundle.format import load_stage
from shards.bundle.masking import CarryMask
from shards.partition.cut import partition_to_bundle
from shards.partition.demo_models import DEMO_MODELS, build_demo
from tests.chain import run_chain


def weights_digest(model: keras.Model) -> str:
    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(np.ascontiguousarray(w).tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("name", sorted(DEMO_MODELS))
def test_two_builds_have_identical_weights(name: str) -> None:
    first, second = build_demo(name), build_demo(name)
    assert len(first.weights) == len(second.weights)
    for a, b in zip(first.get_weights(), second.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_weights_do_not_depend_on_global_random_state() -> None:
    keras.utils.set_random_seed(123)
    a = weights_digest(build_demo("demo-tiny"))
    keras.utils.set_random_seed(456)
    assert weights_digest(build_demo("demo-tiny")) == a


def test_another_process_builds_the_same_weights() -> None:
    code = (
        "import hashlib, numpy as np\n"
        "from shards.partition.demo_models import build_demo\n"
        "d = hashlib.sha256()\n"
        "for w in build_demo('demo-tiny').get_weights():\n"
        "    d.update(np.ascontiguousarray(w).tobytes())\n"
        "print(d.hexdigest())\n"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == weights_digest(build_demo("demo-tiny"))


@pytest.mark.parametrize(
    ("name", "input_name", "row_shape"),
    [
        ("demo-tiny", "features", (8,)),
        ("demo-mlp", "features", (1024,)),
        ("demo-resnet", "image", (32, 32, 3)),
        ("demo-tokens", "tokens", (None,)),
        ("demo-tagger", "tokens", (None,)),
        ("demo-conv1d", "tokens", (None,)),
    ],
)
def test_inputs_and_outputs_have_meaningful_names(
    name: str, input_name: str, row_shape: tuple[int | None, ...]
) -> None:
    model = build_demo(name)
    assert [t.name for t in model.inputs] == [input_name]
    assert tuple(model.inputs[0].shape[1:]) == row_shape
    assert model.output_names == ["logits"]


def test_demo_models_are_worth_sharding() -> None:
    assert build_demo("demo-mlp").count_params() > 30_000_000
    assert len(build_demo("demo-resnet").layers) > 30


def test_unknown_name_lists_the_demo_models() -> None:
    with pytest.raises(ValueError, match=r"'demo-nope'.*demo-mlp, demo-resnet, demo-tagger"):
        build_demo("demo-nope")


def token_rows(length: int) -> np.ndarray:
    """Three rows of ``length`` tokens: one full, two ending in zeros (the padding token)."""
    rows = np.random.default_rng(length).integers(1, 100, size=(3, length), dtype="int32")
    rows[1, max(1, length // 2) :] = 0
    rows[2, 1:] = 0
    return rows


def answer(model: keras.Model, rows: np.ndarray) -> np.ndarray:
    return np.asarray(model(rows, training=False))


@pytest.mark.parametrize(
    ("name", "masked"), [("demo-tokens", True), ("demo-tagger", True), ("demo-conv1d", False)]
)
def test_token_demos_cut_in_two_and_pad_only_where_masked(
    name: str, masked: bool, tmp_path: Path
) -> None:
    model = build_demo(name)
    manifest = partition_to_bundle(model, tmp_path / "b", stages=2)
    assert len(manifest.stages) == 2
    assert manifest.signature.inputs[0].pad_value == (0 if masked else None)
    # The masked ones re-attach the mask after the cut (shards.bundle.masking).
    second = load_stage(tmp_path / "b", 1)
    assert any(isinstance(layer, CarryMask) for layer in second.layers) == masked
    for length in (1, 12):
        rows = token_rows(length)
        got = run_chain(tmp_path / "b", {"tokens": rows})["logits"]
        np.testing.assert_allclose(got, answer(model, rows), atol=1e-5, rtol=0)
    # A row answers the same padded with zeros to a longer length only under the mask.
    row = token_rows(12)[1:2, :6]
    padded = np.concatenate([row, np.zeros((1, 10), "int32")], axis=1)
    alone, longer = answer(model, row), answer(model, padded)
    if longer.ndim == 3:
        assert longer.shape == (1, 16, 8)
        longer = longer[:, :6]
    gap = float(np.max(np.abs(alone - longer)))
    assert gap <= 1e-5 if masked else gap > 1e-3
