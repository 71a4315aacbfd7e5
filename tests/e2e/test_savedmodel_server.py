"""A plain TensorFlow SavedModel (``tf.saved_model.save`` of a ``tf.Module``, as TF Serving users
have them) served in one stage on the session's Ray: resolved, bundled, loaded in a shard actor
and answered over /predict and V2. A corrupt one fails to load with a one-line reason.

The server runs in this process (ASGI transport): what is under test is the model path, and a
second process would import everything again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from serving.version.life import VersionState
from tests.e2e.inprocess import app_in_process

W = (np.arange(12, dtype=np.float32).reshape(3, 4) - 5.0) / 7.0
B = np.array([0.5, -1.0, 2.0, 0.25], dtype=np.float32)
X = np.array([[1.0, 2.0, 3.0], [-0.5, 0.0, 4.0]], dtype=np.float32)
K = np.array([3, -7], dtype=np.int32)


def _save_module(path: Path) -> None:
    """Two inputs of different dtypes, a dict of two outputs, weights held in tf.Variables."""
    import tensorflow as tf

    class Affine(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = tf.Variable(W)
            self.b = tf.Variable(B)

        @tf.function(
            input_signature=[
                tf.TensorSpec((None, 3), tf.float32, name="x"),
                tf.TensorSpec((None,), tf.int32, name="k"),
            ]
        )
        def serve(self, x: tf.Tensor, k: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"y": tf.matmul(x, self.w) + self.b, "k2": k * 2}

    module = Affine()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tfmodule") / "affine"
    _save_module(path)
    return path


@asynccontextmanager
async def _serving(
    model: Path, ray_address: str, cache: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, object]]:
    from serving.settings.config import Settings

    settings = Settings(
        model=str(model),
        ray_address=ray_address,
        cache_dir=cache,
        max_batch_size=4,
        batch_timeout_ms=0,
        cpus_per_shard=1,
    )
    async with app_in_process(settings) as (state, client):
        model = state.model()
        await model.until_loaded()
        yield client, model


async def test_tf_module_savedmodel_serves_predict_and_v2(
    module_dir: Path, ray_address: str, tmp_path: Path
) -> None:
    async with _serving(module_dir, ray_address, tmp_path / "cache") as (client, model):
        assert model.state is not VersionState.FAILED, model.reason
        await model.until_ready()
        rows = await client.post(
            "/v1/models/affine:predict",
            json={"instances": [{"x": x.tolist(), "k": int(k)} for x, k in zip(X, K, strict=True)]},
        )
        v2 = await client.post(
            "/v2/models/affine/infer",
            json={
                "inputs": [
                    {"name": "x", "shape": [2, 3], "datatype": "FP32", "data": X.ravel().tolist()},
                    {"name": "k", "shape": [2], "datatype": "INT32", "data": K.tolist()},
                ]
            },
        )
        meta = await client.get("/v2/models/affine")
    want_y = X @ W + B
    assert rows.status_code == 200, rows.text
    predictions = rows.json()["predictions"]
    np.testing.assert_allclose([p["y"] for p in predictions], want_y, rtol=1e-6)
    assert [p["k2"] for p in predictions] == (K * 2).tolist()
    assert v2.status_code == 200, v2.text
    outputs = {o["name"]: o for o in v2.json()["outputs"]}
    assert (outputs["y"]["datatype"], outputs["y"]["shape"]) == ("FP32", [2, 4])
    np.testing.assert_allclose(np.reshape(outputs["y"]["data"], (2, 4)), want_y, rtol=1e-6)
    assert (outputs["k2"]["datatype"], outputs["k2"]["data"]) == ("INT32", (K * 2).tolist())
    assert {t["name"]: t["datatype"] for t in meta.json()["inputs"]} == {"k": "INT32", "x": "FP32"}


async def test_corrupt_savedmodel_fails_with_one_line_reason(
    module_dir: Path, ray_address: str, tmp_path: Path
) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(module_dir, broken)
    pb = broken / "saved_model.pb"
    pb.write_bytes(pb.read_bytes()[:100])  # cut short: not a protobuf any more
    async with _serving(broken, ray_address, tmp_path / "cache") as (client, _):
        ready = await client.get("/readyz")
    assert ready.status_code == 503
    error = ready.json()["error"]
    assert "cannot read SavedModel broken: " in error, error
    assert "attribute" not in error and "Traceback" not in error, error
    assert str(tmp_path) not in error and "/" + broken.parent.name not in error, error
