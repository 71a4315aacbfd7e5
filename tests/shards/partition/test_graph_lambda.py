"""Lambda layers (Python bytecode in the model file) load only with --unsafe-deserialization;
without it the refusal is one line that names the flag."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
from typer.testing import CliRunner

from serving.cli.main import app
from shards.bundle.format import BundleError
from shards.partition.cut import partition_to_bundle
from shards.partition.graph import PartitionError
from shards.pipeline.replica_set import PipelineOptions, PipelineStartError, ReplicaSet
from tests.chain import run_chain

ROWS = np.random.default_rng(15).normal(size=(3, 4)).astype("float32")


def lambda_model() -> keras.Model:
    keras.utils.set_random_seed(15)
    x = keras.Input((4,), name="x")
    h = keras.layers.Dense(4, name="pre")(x)
    h = keras.layers.Lambda(lambda t: t * 2.0 + 1.0, name="affine")(h)
    return keras.Model(x, keras.layers.Dense(2, name="out")(h), name="with_lambda")


def _assert_refusal(message: str) -> None:
    assert "--unsafe-deserialization" in message and "Lambda" in message
    assert "\n" not in message and "arbitrary code" not in message  # not Keras's own text


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, keras.Model]:
    model = lambda_model()
    path = tmp_path_factory.mktemp("lambda") / "model.keras"
    model.save(path)
    return path, model


def test_partition_of_a_lambda_file_needs_the_flag(
    saved: tuple[Path, keras.Model], tmp_path: Path
) -> None:
    path, model = saved
    with pytest.raises(PartitionError) as refused:
        partition_to_bundle(path, tmp_path / "refused", stages=2)
    _assert_refusal(str(refused.value))

    partition_to_bundle(path, tmp_path / "b", stages=3, unsafe_deserialization=True)
    got = run_chain(tmp_path / "b", {"x": ROWS}, unsafe_deserialization=True)["out"]
    np.testing.assert_allclose(got, keras.ops.convert_to_numpy(model(ROWS)), atol=1e-5)


def test_stages_with_a_lambda_load_only_with_the_flag(tmp_path: Path) -> None:
    model = lambda_model()
    partition_to_bundle(model, tmp_path / "b", stages=3)
    with pytest.raises(BundleError) as refused:
        run_chain(tmp_path / "b", {"x": ROWS})
    _assert_refusal(str(refused.value))
    assert "stage 1 (stage_001.keras)" in str(refused.value)


def test_cli_partition_takes_the_flag(saved: tuple[Path, keras.Model], tmp_path: Path) -> None:
    path, _ = saved
    runner = CliRunner()
    args = ["partition", str(path), "--stages", "2"]
    refused = runner.invoke(app, [*args, "--out", str(tmp_path / "refused")])
    assert refused.exit_code == 1
    assert "--unsafe-deserialization" in refused.output
    done = runner.invoke(app, [*args, "--out", str(tmp_path / "b"), "--unsafe-deserialization"])
    assert done.exit_code == 0, done.output


async def test_shard_actors_load_a_lambda_stage_only_with_the_flag(
    ray_address: str, tmp_path: Path
) -> None:
    model = lambda_model()
    partition_to_bundle(model, tmp_path / "b", stages=2)
    with pytest.raises(PipelineStartError, match="--unsafe-deserialization"):
        await ReplicaSet.create(
            tmp_path / "b", PipelineOptions(batch_sizes=(3,), cpus_per_shard=0.5, max_restarts=0)
        )
    options = PipelineOptions(batch_sizes=(3,), cpus_per_shard=0.5, unsafe_deserialization=True)
    group = await ReplicaSet.create(tmp_path / "b", options)
    try:
        out = await group.run({"x": ROWS})
    finally:
        await group.close()
    np.testing.assert_allclose(out["out"], keras.ops.convert_to_numpy(model(ROWS)), atol=1e-5)
