"""ShardActor on the session Ray: only its stage's weights, exact outputs, no retrace, simulation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import ray
from model_zoo import Inputs, call_whole, sequential

from shards.actor import ShardActor
from shards.bundle import Manifest, read_manifest
from shards.partition import partition_to_bundle

WARM_SIZES = [1, 3, 8]


@pytest.fixture(scope="module")
def seq_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, keras.Model, Inputs]:
    model, inputs = sequential()
    out = tmp_path_factory.mktemp("seq_bundle")
    partition_to_bundle(model, out, stages=2)
    return out, model, inputs


@pytest.fixture(scope="module")
def manifest(seq_bundle: tuple[Path, keras.Model, Inputs]) -> Manifest:
    return read_manifest(seq_bundle[0])


@pytest.fixture(scope="module")
def actors(ray_address: str, seq_bundle: tuple[Path, keras.Model, Inputs]) -> Iterator[list[Any]]:
    remote: Any = ray.remote(ShardActor).options(num_cpus=1, max_concurrency=1)
    handles = [remote.remote(str(seq_bundle[0]), k, WARM_SIZES) for k in range(2)]
    yield handles
    for handle in handles:
        ray.kill(handle)


def test_each_actor_holds_only_its_stage_weights(
    actors: list[Any], manifest: Manifest, seq_bundle: tuple[Path, keras.Model, Inputs]
) -> None:
    whole_bytes = sum(w.nbytes for w in seq_bundle[1].get_weights())
    infos = ray.get([a.info.remote() for a in actors])

    for stage, info in zip(manifest.stages, infos, strict=True):
        assert info["stage_index"] == stage.index
        assert info["weight_bytes"] == stage.param_bytes == info["param_bytes"]
        assert 0 < info["weight_bytes"] < whole_bytes
    assert sum(i["weight_bytes"] for i in infos) == whole_bytes


def test_cpu_actor_uses_the_threads_of_its_cpus(actors: list[Any]) -> None:
    info = ray.get(actors[0].info.remote())

    assert info["device"] == "/CPU:0"
    assert info["intra_op_threads"] == 1
    assert info["gpu_ids"] == []


def test_chained_actors_match_the_whole_model(
    actors: list[Any], seq_bundle: tuple[Path, keras.Model, Inputs]
) -> None:
    _, model, inputs = seq_bundle
    expected = call_whole(model, inputs)

    out = ray.get(actors[1].forward.remote(actors[0].forward.remote(inputs)))

    assert sorted(out) == sorted(expected)
    for name, want in expected.items():
        assert isinstance(out[name], np.ndarray)
        np.testing.assert_allclose(out[name], want, atol=1e-5, rtol=0)


def test_no_retrace_at_any_batch_size_after_warmup(actors: list[Any], manifest: Manifest) -> None:
    before = ray.get([a.info.remote() for a in actors])
    spec = manifest.signature.inputs[0]

    for rows in [*WARM_SIZES, 2, 5, 17]:
        batch = {spec.name: np.ones((rows, *(d or 1 for d in spec.shape)), spec.dtype)}
        out = ray.get(actors[1].forward.remote(actors[0].forward.remote(batch)))
        assert all(v.shape[0] == rows for v in out.values())

    after = ray.get([a.info.remote() for a in actors])
    assert [i["trace_count"] for i in after] == [i["trace_count"] for i in before] == [1, 1]


def test_forward_names_a_missing_input(actors: list[Any], manifest: Manifest) -> None:
    wanted = manifest.stages[1].inputs[0].name

    with pytest.raises(Exception, match=wanted):
        ray.get(actors[1].forward.remote({"not_an_input": np.zeros((1, 3), "float32")}))


def test_simulated_stage_returns_zeros_of_its_output_specs(
    ray_address: str, seq_bundle: tuple[Path, keras.Model, Inputs], manifest: Manifest
) -> None:
    stage = manifest.stages[0]
    remote: Any = ray.remote(ShardActor).options(num_cpus=2, max_concurrency=1)
    actor = remote.remote(str(seq_bundle[0]), 0, [4], simulate_device_ms=20.0)
    try:
        out = ray.get(actor.forward.remote(seq_bundle[2]))
        stats: dict[str, Any] = ray.get(actor.stats.remote())
        info: dict[str, Any] = ray.get(actor.info.remote())
    finally:
        ray.kill(actor)

    rows = next(iter(seq_bundle[2].values())).shape[0]
    for spec in stage.outputs:
        assert out[spec.name].shape == (rows, *spec.shape)
        assert out[spec.name].dtype == spec.np_dtype
        assert not out[spec.name].any()
    assert stats["calls"] == 1 and len(stats["intervals"]) == 1
    assert stats["last_compute_ms"] >= 20.0
    assert info["simulated"] and info["intra_op_threads"] == 2
