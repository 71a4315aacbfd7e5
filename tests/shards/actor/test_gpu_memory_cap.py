"""The GPU path without a GPU: the memory cap from the plan (TensorFlow's config faked), and the
16-bit cast of a crossing activation made inside the stage's traced call, before the host copy."""

from __future__ import annotations

import logging
import math
from typing import Any

import keras
import ml_dtypes
import numpy as np
import pytest

from shards.actor import gpu_memory
from shards.actor.gpu_memory import GPU_MEMORY_MARGIN, gpu_memory_limit_mib
from shards.actor.stage_actor import _configure_tensorflow, planned_limit_mib, stage_step
from shards.bundle.format import StageMemory, StageSpec
from shards.signature import TensorSpec
from tests.shards.fake_tf import FakeConfig, install_fake_tf

MIB = 1 << 20


def _spec(memory: StageMemory | None) -> StageSpec:
    return StageSpec(
        index=0,
        file="stage_0.keras",
        inputs=(TensorSpec("x", (4,), "float32"),),
        outputs=(TensorSpec("h", (3,), "float32"),),
        param_bytes=200 * MIB,
        flops_per_row=0,
        memory=memory,
    )


def _memory(weight_bytes: int | None = None) -> StageMemory:
    return StageMemory(
        first_layer="a",
        last_layer="b",
        activation_bytes=50 * MIB,
        overhead_bytes=30 * MIB,
        plan_batch_rows=8,
        budget_bytes=None,
        crossing_bytes_per_row=12,
        weight_bytes=weight_bytes,
    )


@pytest.fixture
def fake_tf(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(gpus: list[str], ray_gpus: list[int]) -> FakeConfig:
        return install_fake_tf(monkeypatch, gpus, ray_gpus)

    return install


def test_the_limit_is_the_planned_peak_times_the_margin() -> None:
    # Weights as served (a 16-bit plan) + activations + overhead, times the margin, in MiB.
    assert planned_limit_mib(_spec(_memory()), max_rows=8) == math.ceil(280 * GPU_MEMORY_MARGIN)
    assert planned_limit_mib(_spec(_memory()), max_rows=4) == math.ceil(280 * GPU_MEMORY_MARGIN)
    served = _spec(_memory(weight_bytes=100 * MIB))
    assert planned_limit_mib(served, max_rows=8) == math.ceil(180 * GPU_MEMORY_MARGIN)
    # Batches of more rows than the plan counted (8): their activations too (50 MiB per 8).
    assert planned_limit_mib(_spec(_memory()), max_rows=16) == math.ceil(330 * GPU_MEMORY_MARGIN)
    # A stage never planned (a SavedModel served whole) gets no cap; a tiny one the floor.
    assert planned_limit_mib(_spec(None), max_rows=8) is None
    assert gpu_memory_limit_mib(1000) == gpu_memory.MIN_LIMIT_MIB
    with pytest.raises(ValueError, match="margin >= 1"):
        gpu_memory_limit_mib(MIB, margin=0.5)


def test_the_limit_is_set_on_the_gpu_ray_gave(fake_tf: Any) -> None:
    config = fake_tf(gpus=["gpu0"], ray_gpus=[0])
    device = _configure_tensorflow(350)
    assert device.name == "/GPU:0"
    # A cap and no growth: TensorFlow refuses both on one device.
    assert config.calls == [("logical", "gpu0", [("limit", 350)])]


def test_turned_off_the_gpu_grows_as_before(fake_tf: Any) -> None:
    config = fake_tf(gpus=["gpu0"], ray_gpus=[0])
    _configure_tensorflow(None)
    assert config.calls == [("growth", "gpu0", True)]


def test_with_no_gpu_nothing_is_set_and_it_says_so_once(
    fake_tf: Any, caplog: pytest.LogCaptureFixture
) -> None:
    config = fake_tf(gpus=[], ray_gpus=[])
    with caplog.at_level(logging.INFO, logger=gpu_memory.__name__):
        assert _configure_tensorflow(350).name == "/CPU:0"
        _configure_tensorflow(350)
    assert config.calls == []
    assert sum("no GPU" in r.getMessage() for r in caplog.records) == 1


def test_a_gpu_ray_did_not_give_gets_no_limit(fake_tf: Any) -> None:
    config = fake_tf(gpus=["gpu0"], ray_gpus=[])
    assert _configure_tensorflow(350).name == "/CPU:0"
    assert config.calls == [("visible", [], "GPU")]


@pytest.mark.parametrize(("dtype", "tf_name"), [("bfloat16", "bfloat16"), ("float16", "float16")])
def test_a_crossing_activation_leaves_the_traced_call_in_16_bits(dtype: str, tf_name: str) -> None:
    inputs = keras.Input((4,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(3, name="h")(inputs))
    target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    step = stage_step(model, _spec(None), {"h": target})
    x = np.arange(8, dtype=np.float32).reshape(2, 4)

    (out,) = step(x)

    # Still a tensor (on the stage's device), already narrowed: the host copy moves 16 bits.
    assert not isinstance(out, np.ndarray)
    assert out.dtype.name == tf_name
    host = np.asarray(out)
    assert host.dtype == target
    want = np.asarray(model(x)).astype(target)
    np.testing.assert_array_equal(host, want)
    (whole,) = stage_step(model, _spec(None), {})(x)
    assert whole.dtype.name == "float32"
