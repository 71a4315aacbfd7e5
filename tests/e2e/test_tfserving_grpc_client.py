"""TensorFlow Serving's gRPC API of a real server, called as a TF Serving user calls it: the
official ``tensorflow-serving-api`` stubs and ``tf.make_tensor_proto`` inputs. A model repository
on the session's Ray (the app in process with its gRPC port) serves a one-input model, a
multi-input dict model, a token model (by version and by label) and a version that cannot load;
every answer equals REST's on the same rows. The protocol's details (every dtype, every error
code, health, reflection) are checked in process: tests/serving/protocols/tfserving/."""

from __future__ import annotations

import asyncio
import zipfile
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from shards.partition.demo_models import build_demo
from tests.serverproc import free_ports

TINY = np.arange(16, dtype=np.float32).reshape(2, 8) / 10
SHORT = np.array([[3, 14, 15]], dtype=np.int32)
LONG = np.array([[26, 5, 9, 2, 7, 1, 8]], dtype=np.int32)
FEATURES = np.arange(12, dtype=np.float32).reshape(2, 6) / 7
IDS = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=np.int32)
State = get_model_status_pb2.ModelVersionStatus.State


def _two_input_model(path: Path) -> None:
    import keras

    keras.utils.set_random_seed(21)
    features = keras.Input((6,), name="features")
    ids = keras.Input((4,), dtype="int32", name="ids")
    h = keras.layers.Dense(8, activation="relu", name="dense")(features)
    e = keras.layers.Flatten(name="flat")(keras.layers.Embedding(10, 2, name="embed")(ids))
    z = keras.layers.Dense(8, activation="tanh", name="mix")(keras.layers.Concatenate()([h, e]))
    outputs = {
        "score": keras.layers.Dense(1, name="score_head")(z),
        "klass": keras.layers.Dense(3, name="klass_head")(z),
    }
    keras.Model({"features": features, "ids": ids}, outputs, name="twohead").save(path)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tfsgrpc")
    for name, demo in (("tiny", "demo-tiny"), ("tokens", "demo-tokens")):
        (root / name / "1").mkdir(parents=True)
        build_demo(demo).save(root / name / "1" / f"{name}.keras")
    (root / "tokens" / "config.toml").write_text("[labels]\nstable = 1\n")
    (root / "twohead" / "1").mkdir(parents=True)
    _two_input_model(root / "twohead" / "1" / "twohead.keras")
    (root / "broken" / "1").mkdir(parents=True)
    with zipfile.ZipFile(root / "broken" / "1" / "broken.keras", "w") as broken:
        broken.writestr("config.json", '{"class_name": "NoSuchLayer", "config": {}}')
        broken.writestr("metadata.json", "{}")
    return root


def request(name: str, inputs: dict[str, np.ndarray], **spec: Any) -> predict_pb2.PredictRequest:
    message = predict_pb2.PredictRequest()
    message.model_spec.name = name
    if "version" in spec:
        message.model_spec.version.value = spec["version"]
    if "label" in spec:
        message.model_spec.version_label = spec["label"]
    for key, value in inputs.items():
        message.inputs[key].CopyFrom(tf.make_tensor_proto(value))
    return message


async def test_tfserving_grpc_answers_equal_rests(
    repository: Path, ray_address: str, tmp_path: Path
) -> None:
    from asgi_lifespan import LifespanManager

    from serving.server.app import create_app
    from serving.settings.config import Settings

    (grpc_port,) = free_ports(1)
    settings = Settings(
        model_repository=repository,
        default_model="tokens",
        ray_address=ray_address,
        cache_dir=tmp_path / "cache",
        grpc_port=grpc_port,
        max_batch_size=4,
        batch_timeout_ms=2,
        cpus_per_shard=1,
        max_sequence_length=16,
    )
    app = create_app(settings)
    async with LifespanManager(app, startup_timeout=30, shutdown_timeout=60) as manager:
        state = app.state.shardserve
        await asyncio.wait_for(
            asyncio.gather(*(m.wait_load() for m in state.served()), return_exceptions=True),
            180,
        )
        transport = httpx.ASGITransport(app=manager.app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://t") as http,
            grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
        ):
            predict = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict
            models = model_service_pb2_grpc.ModelServiceStub(channel)

            async def rest(path: str, body: dict[str, Any]) -> Any:
                r = await http.post(f"{path}:predict", json=body, timeout=60)
                assert r.status_code == 200, r.text
                return r.json()

            # One input; the token model by version and by label, two lengths in flight at once.
            tiny, short, long, multi = await asyncio.gather(
                predict(request("tiny", {"features": TINY}), timeout=60),
                predict(request("tokens", {"tokens": SHORT}, version=1), timeout=60),
                predict(request("tokens", {"tokens": LONG}, label="stable"), timeout=60),
                predict(request("twohead", {"features": FEATURES, "ids": IDS}), timeout=60),
            )
            tiny_rest = await rest("/v1/models/tiny", {"instances": TINY.tolist()})
            ragged = await rest(
                "/v1/models/tokens/labels/stable",
                {"instances": [SHORT[0].tolist(), LONG[0].tolist()]},
            )
            multi_rest = await rest(
                "/v1/models/twohead",
                {"inputs": {"features": FEATURES.tolist(), "ids": IDS.tolist()}},
            )

            metadata_request = get_model_metadata_pb2.GetModelMetadataRequest(
                metadata_field=["signature_def"]
            )
            metadata_request.model_spec.name = "tokens"
            metadata = await prediction_service_pb2_grpc.PredictionServiceStub(
                channel
            ).GetModelMetadata(metadata_request, timeout=30)

            status_request = get_model_status_pb2.GetModelStatusRequest()
            status_request.model_spec.name = "broken"
            broken = await models.GetModelStatus(status_request, timeout=30)
            broken_rest = (await http.get("/v1/models/broken")).json()
            status_request.model_spec.name = "tiny"
            tiny_status = await models.GetModelStatus(status_request, timeout=30)

            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await predict(request("tokens", {"tokens": SHORT}, label="canary"), timeout=30)

    output = tiny.outputs
    [name] = list(output)
    np.testing.assert_allclose(
        tf.make_ndarray(output[name]), np.asarray(tiny_rest["predictions"]), rtol=1e-6, atol=1e-6
    )
    assert (tiny.model_spec.name, tiny.model_spec.version.value) == ("tiny", 1)
    [token_output] = list(short.outputs)
    want = [np.asarray(row) for row in ragged["predictions"]]
    np.testing.assert_allclose(tf.make_ndarray(short.outputs[token_output])[0], want[0], atol=1e-6)
    np.testing.assert_allclose(tf.make_ndarray(long.outputs[token_output])[0], want[1], atol=1e-6)
    assert long.model_spec.version.value == 1
    for head in ("score", "klass"):
        np.testing.assert_allclose(
            tf.make_ndarray(multi.outputs[head]), np.asarray(multi_rest["outputs"][head]), atol=1e-6
        )

    signatures = get_model_metadata_pb2.SignatureDefMap()
    assert metadata.metadata["signature_def"].Unpack(signatures)
    tokens_in = signatures.signature_def["serving_default"].inputs["tokens"]
    assert [d.size for d in tokens_in.tensor_shape.dim] == [-1, -1]

    [failed] = broken.model_version_status
    assert failed.state == State.END and failed.status.error_message
    assert broken_rest["model_version_status"][0]["state"] == "END"
    assert broken_rest["model_version_status"][0]["status"]["error_message"] == (
        failed.status.error_message
    )
    assert [v.state for v in tiny_status.model_version_status] == [State.AVAILABLE]
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
