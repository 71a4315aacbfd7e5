"""A .keras file with a Lambda layer: the server refuses it with the flag to pass, and serves it
(cut in 2 stages) with ``--unsafe-deserialization true``."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.serverproc import running_server

ROWS = np.random.default_rng(16).normal(size=(3, 4)).astype("float32")


@pytest.fixture(scope="module")
def lambda_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    import keras

    keras.utils.set_random_seed(16)
    x = keras.Input((4,), name="x")
    h = keras.layers.Dense(4, name="pre")(x)
    h = keras.layers.Lambda(lambda t: t * 2.0 + 1.0, name="affine")(h)
    model = keras.Model(x, keras.layers.Dense(2, name="out")(h), name="with_lambda")
    path = tmp_path_factory.mktemp("unsafe") / "lambda.keras"
    model.save(path)
    return path, keras.ops.convert_to_numpy(model(ROWS))


def _args(path: Path, ray_address: str, cache: Path) -> list[str]:
    return ["--model", str(path), "--stages", "2", "--ray-address", ray_address,
            "--cache-dir", str(cache)]  # fmt: skip


def test_refused_without_the_flag(
    ray_address: str, lambda_file: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    path, _ = lambda_file
    with running_server(_args(path, ray_address, tmp_path / "cache"), tmp_path, ready=False) as srv:
        assert srv.process.wait(timeout=300) == 1
        # The closing message, which the console wraps at its width.
        said = " ".join(srv.output().split())
        reason = said.rsplit("error: the model failed to load:", 1)[-1]
        assert "holds a Lambda layer" in reason and "--unsafe-deserialization" in reason, reason


def test_served_with_the_flag(
    ray_address: str, lambda_file: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    path, want = lambda_file
    args = [*_args(path, ray_address, tmp_path / "cache"), "--unsafe-deserialization", "true"]
    with running_server(args, tmp_path) as srv:
        reply = httpx.post(f"{srv.url}/predict", json={"instances": ROWS.tolist()}, timeout=60)
        assert reply.status_code == 200, reply.text
        got = np.asarray(reply.json()["predictions"], dtype="float32")
    np.testing.assert_allclose(got, want, atol=1e-5)
