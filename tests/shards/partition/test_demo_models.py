"""Demo models: names, signatures, and the same weights on every build in any process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from shards.partition.demo_models import DEMO_MODELS, build_demo


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
    ],
)
def test_inputs_and_outputs_have_meaningful_names(
    name: str, input_name: str, row_shape: tuple[int, ...]
) -> None:
    model = build_demo(name)
    assert [t.name for t in model.inputs] == [input_name]
    assert tuple(model.inputs[0].shape[1:]) == row_shape
    assert model.output_names == ["logits"]


def test_demo_models_are_worth_sharding() -> None:
    assert build_demo("demo-mlp").count_params() > 30_000_000
    assert len(build_demo("demo-resnet").layers) > 30


def test_unknown_name_lists_the_demo_models() -> None:
    with pytest.raises(ValueError, match=r"'demo-nope'.*demo-mlp, demo-resnet, demo-tiny"):
        build_demo("demo-nope")
