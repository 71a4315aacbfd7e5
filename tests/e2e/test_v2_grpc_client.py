"""The V2 gRPC service of a real server, checked with Triton's own client (``tritonclient.grpc``).

``shardserve serve --model demo-tiny --stages 2 --grpc-port <free>`` on the session's Ray; every
answer is compared with ``/predict``'s on the same rows. (Several inputs and outputs over gRPC are
checked in process, tests/serving/protocols/v2/test_v2_grpc.py; the real multi-input model over HTTP.)
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from tritonclient.utils import InferenceServerException

from tests.serverproc import Server, free_ports, running_server

TINY = "demo-tiny"


@dataclass
class GrpcServer:
    http: Server
    grpc_url: str

    def client(self) -> triton.InferenceServerClient:
        return triton.InferenceServerClient(url=self.grpc_url)

    def predict(self, instances: list[object]) -> list[object]:
        r = httpx.post(f"{self.http.url}/predict", json={"instances": instances}, timeout=60)
        assert r.status_code == 200, r.text
        predictions: list[object] = r.json()["predictions"]
        return predictions


@pytest.fixture(scope="module")
def server(
    ray_address: str, demo_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GrpcServer]:
    workdir = tmp_path_factory.mktemp("v2grpc")
    (port,) = free_ports(1)
    args = ["--model", TINY, "--stages", "2", "--ray-address", ray_address,
            "--cache-dir", str(demo_cache), "--max-batch-size", "8",
            "--batch-timeout-ms", "2", "--grpc-port", str(port)]  # fmt: skip
    with running_server(args, workdir) as http:
        yield GrpcServer(http, f"127.0.0.1:{port}")


def test_health_metadata_and_config(server: GrpcServer) -> None:
    client = server.client()
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(TINY) and client.is_model_ready(TINY, "1")
    server_meta = client.get_server_metadata(as_json=True)
    assert server_meta["name"] == "shardserve"
    assert "binary_tensor_data" in server_meta["extensions"]
    meta = client.get_model_metadata(TINY)
    assert (meta.name, list(meta.versions), meta.platform) == (TINY, ["1"], "tensorflow_keras")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("features", "FP32", [-1, 8])
    ]
    assert [(t.datatype, list(t.shape)) for t in meta.outputs] == [("FP32", [-1, 4])]
    # Triton's own ModelConfig message reads the answer.
    config = client.get_model_config(TINY).config
    assert (config.name, config.max_batch_size) == (TINY, 8)
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        ("features", triton.model_config_pb2.TYPE_FP32, [8])
    ]
    assert [(o.data_type, list(o.dims)) for o in config.output] == [
        (triton.model_config_pb2.TYPE_FP32, [4])
    ]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    # The same answers as the HTTP routes'.
    http = httpx.get(f"{server.http.url}/v2/models/{TINY}", timeout=10).json()
    assert [o["name"] for o in http["outputs"]] == [o.name for o in meta.outputs]


def test_unknown_model_is_not_found(server: GrpcServer) -> None:
    client = server.client()
    for call in (client.is_model_ready, client.get_model_metadata, client.get_model_config):
        with pytest.raises(InferenceServerException) as err:
            call("nope")
        assert err.value.status() == "StatusCode.NOT_FOUND"
        assert err.value.message() == "model 'nope' not found; this server serves 'demo-tiny'"


def test_infer_equals_predict(server: GrpcServer) -> None:
    client = server.client()
    output = client.get_model_metadata(TINY).outputs[0].name
    rows = np.random.default_rng(7).normal(size=(5, 8)).astype(np.float32)
    inp = triton.InferInput("features", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows)
    result = client.infer(
        TINY, [inp], outputs=[triton.InferRequestedOutput(output)], request_id="tiny-1"
    )
    got = result.as_numpy(output)
    want = np.asarray(server.predict(rows.tolist()), np.float32)
    assert got.dtype == np.float32 and got.shape == (5, 4)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == ("tiny-1", TINY, "1")


def test_concurrent_single_rows_through_the_aio_client(server: GrpcServer) -> None:
    rows = np.random.default_rng(8).normal(size=(16, 8)).astype(np.float32)

    async def run() -> list[np.ndarray]:
        client = triton_aio.InferenceServerClient(url=server.grpc_url)
        try:

            async def one(row: np.ndarray) -> np.ndarray:
                inp = triton_aio.InferInput("features", [1, 8], "FP32")
                inp.set_data_from_numpy(row[None, :])
                result = await client.infer(TINY, [inp], client_timeout=60)
                return result.as_numpy(result.get_response().outputs[0].name)[0]

            return await asyncio.gather(*(one(row) for row in rows))
        finally:
            await client.close()

    got = np.stack(asyncio.run(run()))
    want = np.asarray(server.predict(rows.tolist()), np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_bad_datatype_is_invalid_argument(server: GrpcServer) -> None:
    client = server.client()
    inp = triton.InferInput("features", [1, 8], "FP64")
    inp.set_data_from_numpy(np.zeros((1, 8), np.float64))
    with pytest.raises(InferenceServerException) as err:
        client.infer(TINY, [inp])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert err.value.message() == "input 'features' has datatype FP64; the model expects FP32"


def test_the_kserve_sdk_clients_get_the_same_answers(server: GrpcServer) -> None:
    rows = np.random.default_rng(9).standard_normal((3, 8)).astype(np.float32).round(3)
    script = Path(__file__).with_name("kserve_clients.py")
    done = subprocess.run(
        [sys.executable, str(script), server.http.url, server.grpc_url, TINY, "features",
         json.dumps(rows.tolist())],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])

    assert result["rest_ready"] == [True, True, True]
    assert result["grpc_ready"] == [True, True, True]
    want = np.asarray(server.predict(rows.tolist()))
    for key in ("rest_binary_False", "rest_binary_True", "grpc"):
        np.testing.assert_allclose(np.asarray(result[key]), want, atol=1e-6, err_msg=key)
