"""One reference per tensor on the session Ray: a stage receives exactly the tensors it reads (a
skip tensor past the middle stage goes straight to its reader), and reduced precision between
shards: 16-bit activations halve the bytes across a cut and stay close to float32, model outputs
stay float32, and weights served in 16 bits take half the memory and stay close."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from shards.bundle.format import Manifest, read_manifest
from shards.bundle.tensor_routes import plan_routes
from shards.partition.cut import partition_to_bundle
from shards.pipeline.replica_set import PipelineOptions, ReplicaSet
from shards.signature import TensorSpec
from tests.shards.model_zoo import Inputs, call_whole

Case = tuple[Path, keras.Model, Inputs]
ROWS = 4


def _skip_model() -> tuple[keras.Model, Inputs]:
    """Six equal Dense layers and a skip from the first to the last: cut in 3 stages, the skip
    tensor is made in stage 0 and read only in stage 2."""
    keras.utils.set_random_seed(12)
    features = keras.Input((32,), name="features")
    first = keras.layers.Dense(32, activation="tanh", name="d0")(features)
    x = first
    for i in range(1, 6):
        x = keras.layers.Dense(32, activation="tanh", name=f"d{i}")(x)
    x = keras.layers.Add(name="skip")([x, first])
    out = keras.layers.Dense(8, name="logits")(x)
    rows = np.random.default_rng(12).normal(size=(ROWS, 32)).astype("float32")
    return keras.Model(features, out, name="skip3"), {"features": rows}


@pytest.fixture(scope="module")
def skip_case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    model, inputs = _skip_model()
    out = tmp_path_factory.mktemp("skip3")
    partition_to_bundle(model, out, stages=3)
    return out, model, inputs


def _nbytes(specs: tuple[TensorSpec, ...], itemsize: int | None = None) -> int:
    return sum(
        ROWS * math.prod(d or 1 for d in t.shape) * (itemsize or t.np_dtype.itemsize) for t in specs
    )


async def _run(bundle: Path, inputs: Inputs, **options: Any) -> tuple[dict[str, Any], list[Any]]:
    group = await ReplicaSet.create(bundle, PipelineOptions(batch_sizes=(ROWS,), **options))
    try:
        out = await group.run(inputs)
        pipeline = group._pipelines[0]
        stats = [await a.stats.remote() for a in pipeline.actors]
        infos = [await a.info.remote() for a in pipeline.actors]
    finally:
        await group.close()
    return out, [stats, infos]


def _cut_in_stage_2(manifest: Manifest) -> None:
    routes, _ = plan_routes(manifest)
    late = [s for s in routes[2].inputs if s.stage == 0]
    assert late, f"the cuts left no tensor from stage 0 to stage 2: {routes}"
    assert all(s.stage != 0 for s in routes[1].inputs[1:])


async def test_each_stage_receives_only_the_tensors_it_reads(
    ray_address: str, skip_case: Case
) -> None:
    bundle, model, inputs = skip_case
    manifest = read_manifest(bundle)
    _cut_in_stage_2(manifest)

    out, (stats, _) = await _run(bundle, inputs)

    for name, want in call_whole(model, inputs).items():
        np.testing.assert_allclose(out[name], want, atol=1e-5, rtol=0)
    for stage, stat in zip(manifest.stages, stats, strict=True):
        # Each tensor it reads, once: not the whole output of every upstream stage.
        assert stat["bytes_in_total"] == _nbytes(stage.inputs)
        assert stat["bytes_out_total"] == _nbytes(stage.outputs)


@pytest.mark.parametrize(
    ("dtype", "compiled", "tolerance"),
    [("bfloat16", False, 3e-2), ("float16", True, 3e-3)],
)
async def test_reduced_activations_halve_the_bytes_across_cuts(
    ray_address: str, skip_case: Case, dtype: str, compiled: bool, tolerance: float
) -> None:
    bundle, model, inputs = skip_case
    manifest = read_manifest(bundle)

    out, (stats, _) = await _run(bundle, inputs, activation_dtype=dtype, compiled_graph=compiled)

    expected = call_whole(model, inputs)
    for name, want in expected.items():
        assert out[name].dtype == np.float32  # model outputs are not cast
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(out[name], want, atol=tolerance * scale, rtol=0)
        assert not np.array_equal(out[name], want)  # the cut really was narrowed
    *inner, last = manifest.stages
    for stage, stat in zip(inner, stats[:-1], strict=True):
        # Every output of stages 0 and 1 crosses a cut: 2 bytes a value instead of 4.
        assert stat["bytes_out_total"] == _nbytes(stage.outputs, itemsize=2)
        assert stat["bytes_out_total"] * 2 == _nbytes(stage.outputs)
    assert stats[-1]["bytes_out_total"] == _nbytes(last.outputs)
    assert stats[-1]["bytes_in_total"] == _nbytes(last.inputs, itemsize=2)


@pytest.mark.parametrize(("dtype", "tolerance"), [("bfloat16", 3e-2), ("float16", 3e-3)])
async def test_weights_served_in_reduced_precision(
    ray_address: str, skip_case: Case, dtype: str, tolerance: float
) -> None:
    bundle, model, inputs = skip_case
    manifest = read_manifest(bundle)

    out, (_, infos) = await _run(bundle, inputs, weight_dtype=dtype)

    for stage, info in zip(manifest.stages, infos, strict=True):
        assert info["weight_bytes"] * 2 == stage.param_bytes
        # The plan (made for float32 weights) is compared with the weights as served.
        planned = stage.planned_peak_bytes - stage.param_bytes // 2
        assert info["memory"]["planned_peak_bytes"] == planned
    for name, want in call_whole(model, inputs).items():
        assert out[name].dtype == np.float32
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(out[name], want, atol=tolerance * scale, rtol=0)


def test_unknown_reduced_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match=r"activation_dtype must be one of .*got 'int8'"):
        PipelineOptions(activation_dtype="int8")
