"""A shard actor reports what it really holds: RSS at its start-up marks and now, beside the
plan of its stage from the manifest."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import pytest
import ray

from shards.actor.stage_actor import ShardActor
from shards.bundle.format import Manifest, read_manifest
from shards.partition.cut import partition_to_bundle

MiB = 2**20


def wide_mlp() -> keras.Model:
    features = keras.Input((1024,), name="features")
    x = features
    for i in range(4):  # 4 x 4 MiB of weights: what loading adds stands out of the noise
        x = keras.layers.Dense(1024, name=f"d{i}")(x)
    return keras.Model(features, x)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    out = tmp_path_factory.mktemp("memory_bundle")
    partition_to_bundle(wide_mlp(), out, stages=2, plan_batch_rows=8)
    return out, read_manifest(out)


@pytest.fixture(scope="module")
def actor(ray_address: str, bundle: tuple[Path, Manifest]) -> Iterator[Any]:
    remote: Any = ray.remote(ShardActor).options(num_cpus=1)
    handle = remote.remote(str(bundle[0]), 1, [1, 8])
    yield handle
    ray.kill(handle)


def test_info_reports_measured_memory_beside_the_plan(
    actor: Any, bundle: tuple[Path, Manifest]
) -> None:
    spec = bundle[1].stages[1]
    memory = ray.get(actor.info.remote())["memory"]
    assert spec.memory is not None and spec.memory.plan_batch_rows == 8
    assert memory["planned_peak_bytes"] == spec.planned_peak_bytes
    assert memory["planned_peak_bytes"] == (
        spec.param_bytes + spec.memory.activation_bytes + spec.memory.overhead_bytes
    )
    assert memory["weight_bytes"] == spec.param_bytes == 2 * (1024 * 1024 + 1024) * 4
    marks = memory["rss_marks"]
    assert list(marks) == ["start", "tensorflow", "weights", "loaded"]
    # Importing TensorFlow costs hundreds of MB; the stage's 8 MiB of weights sit above that,
    # before the warm-up runs a batch.
    assert marks["tensorflow"] - marks["start"] > 100 * MiB
    assert marks["weights"] - marks["tensorflow"] >= spec.param_bytes
    assert memory["rss_bytes"] >= marks["tensorflow"]
    assert memory["rss_peak_bytes"] >= memory["rss_bytes"]
    assert memory["rss_above_tensorflow_bytes"] == memory["rss_bytes"] - marks["tensorflow"]
    # The object store's pages it maps are part of the RSS, reported apart.
    assert 0 <= memory["rss_shared_memory_bytes"] <= memory["rss_bytes"]
    assert memory["gpu"] is None  # a CPU actor


def test_stats_carry_the_memory_for_the_metrics(actor: Any) -> None:
    memory = ray.get(actor.stats.remote())["memory"]
    assert memory["rss_bytes"] > 0 and memory["planned_peak_bytes"] > 0
