"""What a generation replica's actors ask of Ray and cap their GPU at, from their plans (issue 42
items 5 and 7): a stage its weights, KV cache and largest step; a head part its rows. The GPU
path without a GPU: ``tf.config`` faked (tests/shards/fake_tf.py), the actors real."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from shards.actor.gpu_memory import GPU_MEMORY_MARGIN, MIN_LIMIT_MIB, gpu_memory_limit_mib
from shards.generation.actor import GenerationStage
from shards.generation.head_part import HeadPart
from shards.generation.partition import (
    kv_cache_bytes,
    plan_generation,
    plan_head_parts,
    step_activation_bytes,
)
from shards.generation.preset import PresetSpec, read_preset
from shards.generation.sizing import part_gpus, replica_asks
from tests.shards.fake_tf import install_fake_tf

MIB = 1 << 20
GPT2_SMALL_PARAMS = 124_439_808  # the published count of gpt2 (124M)


@pytest.fixture(scope="module")
def gpt2_small(gpt2_preset: Path) -> PresetSpec:
    """The tiny preset's spec with GPT-2 small's sizes (the plan reads only the spec)."""
    spec = read_preset(str(gpt2_preset))
    config = {
        **spec.config,
        "vocabulary_size": 50257,
        "num_layers": 12,
        "num_heads": 12,
        "hidden_dim": 768,
        "intermediate_dim": 3072,
        "max_sequence_length": 1024,
    }
    return dataclasses.replace(
        spec,
        config=config,
        num_layers=12,
        hidden_dim=768,
        vocabulary_size=50257,
        kv_heads=12,
        head_dim=64,
        max_length_bound=1024,
    )


def test_a_stages_cap_is_its_weights_kv_cache_and_largest_step(gpt2_small: PresetSpec) -> None:
    (plan,) = plan_generation(gpt2_small, 1, kv_slots=8, max_length=1024)
    assert plan.weight_bytes == GPT2_SMALL_PARAMS * 4
    assert plan.kv_cache_bytes == kv_cache_bytes(gpt2_small, 12, 8, 1024) == 679_477_248
    # The largest step: 8 slots each prefilling 1,024 tokens. Its attention scores and softmax
    # (float32, 8 x 12 heads x 1,024 x 1,024, twice) are most of it; with the head, the logits.
    scores = 2 * 8 * 12 * 1024 * 1024 * 4
    assert scores < plan.step_bytes < 2 * scores
    assert plan.step_bytes == step_activation_bytes(gpt2_small, 8, 1024, head_rows=50257)
    assert plan.planned_peak_bytes == plan.weight_bytes + plan.kv_cache_bytes + plan.step_bytes
    (ask,) = replica_asks(gpt2_small, 1, 8, 1024, gpus=1.0).stages
    assert ask.gpu_limit_mib == math.ceil(plan.planned_peak_bytes * GPU_MEMORY_MARGIN / MIB)
    # Without the step the cap would be under the step's own scores: a full prefill would fail.
    assert (plan.weight_bytes + plan.kv_cache_bytes) * (GPU_MEMORY_MARGIN - 1) < scores
    # Shorter slots: the square of the length goes.
    (short,) = plan_generation(gpt2_small, 1, kv_slots=8, max_length=256)
    assert short.step_bytes < plan.step_bytes / 4


def test_head_parts_are_sized_from_their_rows_not_a_stages(gpt2_small: PresetSpec) -> None:
    parts = plan_head_parts(gpt2_small, 2, kv_slots=8)
    assert [(p.start, p.stop) for p in parts] == [(0, 25129), (25129, 50257)]
    assert [p.weight_bytes for p in parts] == [25129 * 768 * 4, 25128 * 768 * 4]
    # A step: each slot's logits over the part's rows (and a cast), and the hidden states in.
    assert parts[0].step_bytes == 2 * 8 * (25129 + 768) * 4
    assert plan_head_parts(gpt2_small, 1, kv_slots=8) == []

    on_gpus = replica_asks(gpt2_small, 2, 8, 1024, 2, cpus=1.0, gpus=1.0)
    widest = max(a.planned_peak_bytes for a in on_gpus.stages)
    for ask, part in zip(on_gpus.heads, parts, strict=True):
        assert ask.planned_peak_bytes == part.planned_peak_bytes
        assert ask.gpu_limit_mib == gpu_memory_limit_mib(part.planned_peak_bytes)
        # A share of a stage's GPU as its plan is of the widest stage's: 2 parts pack onto one.
        assert ask.gpus == math.ceil(100 * part.planned_peak_bytes / widest) / 100 < 0.5
        assert ask.memory_bytes is None  # device memory: not Ray's to count
        assert ask.bundle() == {"CPU": 1.0, "GPU": ask.gpus}
    assert [a.gpus for a in on_gpus.stages] == [1.0, 1.0]

    on_cpus = replica_asks(gpt2_small, 2, 8, 1024, 2, cpus=0.5)
    # Without GPUs each actor asks Ray's memory resource for what it holds: a part its rows, a
    # stage its weights and KV cache (not a worst-case step's activations).
    assert [a.memory_bytes for a in on_cpus.heads] == [p.weight_bytes for p in parts]
    assert [a.bundle() for a in on_cpus.heads] == [
        {"CPU": 0.5, "memory": float(p.weight_bytes)} for p in parts
    ]
    stage_plans = plan_generation(gpt2_small, 2, 8, 1024, head_parts=2)
    assert [a.memory_bytes for a in on_cpus.stages] == [p.total_bytes for p in stage_plans]
    assert on_cpus.bundles() == [a.bundle() for a in (*on_cpus.stages, *on_cpus.heads)]


def test_a_parts_gpu_share_is_one_ray_takes() -> None:
    assert part_gpus(1.0, 10, 100) == 0.1
    assert part_gpus(1.0, 101, 1000) == 0.11  # rounded up, never under its plan
    assert part_gpus(1.0, 1, 10**9) == 0.01  # at least a hundredth
    assert part_gpus(0.5, 300, 100) == 0.5  # at most a stage's
    assert part_gpus(4.0, 60, 100) == 3.0  # past one GPU: whole ones
    assert part_gpus(0.0, 10, 100) == 0.0


def test_the_setting_off_caps_nothing(gpt2_small: PresetSpec) -> None:
    asks = replica_asks(gpt2_small, 2, 8, 1024, 2, gpus=1.0, gpu_memory_limit=False)
    assert [a.gpu_limit_mib for a in (*asks.stages, *asks.heads)] == [None] * 4


def _head_file(tmp_path: Path) -> str:
    path = tmp_path / "head-0.npz"
    np.savez(path, kernel=np.ones((10, 4), np.float32), offset=np.int64(0))
    return str(path)


def test_a_head_part_caps_the_gpu_ray_gave_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = install_fake_tf(monkeypatch, gpus=["gpu0"], ray_gpus=[0])
    part = HeadPart(_head_file(tmp_path), 100)
    # A cap and no growth: TensorFlow refuses both on one device.
    assert config.calls == [("logical", "gpu0", [("limit", 100)])]
    held = part.describe()
    assert (held["gpu_memory_limit_mib"], held["device"]) == (100, "/GPU:0")
    config = install_fake_tf(monkeypatch, gpus=["gpu0"], ray_gpus=[0])
    HeadPart(_head_file(tmp_path), None)  # gpu_memory_limit off
    assert config.calls == [("growth", "gpu0", True)]


def test_with_no_gpu_a_head_part_sets_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = install_fake_tf(monkeypatch, gpus=[], ray_gpus=[])
    assert HeadPart(_head_file(tmp_path), 100).describe()["device"] == "/CPU:0"
    assert config.calls == []


def test_a_generation_stage_caps_the_gpu_ray_gave_it(
    monkeypatch: pytest.MonkeyPatch, gpt2_preset: Path
) -> None:
    config = install_fake_tf(monkeypatch, gpus=["gpu0"], ray_gpus=[0])
    stage = GenerationStage(str(gpt2_preset), 0, 2, 2, 8, memory_limit_mib=MIN_LIMIT_MIB)
    assert config.calls == [("logical", "gpu0", [("limit", MIN_LIMIT_MIB)])]
    assert stage.describe()["gpu_memory_limit_mib"] == MIN_LIMIT_MIB
    config = install_fake_tf(monkeypatch, gpus=[], ray_gpus=[])
    GenerationStage(str(gpt2_preset), 2, 4, 2, 8, memory_limit_mib=MIN_LIMIT_MIB)
    assert config.calls == []
