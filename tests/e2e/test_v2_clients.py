"""The V2 routes of a real server, checked with Triton's own clients (``tritonclient.http`` and
``tritonclient.grpc``).

Two servers on the session's Ray, started side by side: ``demo-tiny`` in 2 stages with its gRPC
port on (``--grpc-port <free>``), and a Keras model with two named inputs (one of them int32 ids)
and a dict of two outputs, in 1 stage (the pipeline's own tests cut such models; one stage keeps
this module near a minute). Every answer is compared with ``/predict``'s on the same rows. The
HTTP and gRPC tests share the demo-tiny server: one start, not two. (Several inputs and outputs
over gRPC are checked in process, tests/serving/protocols/v2/test_v2_grpc.py; the real
multi-input model over HTTP.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.grpc.aio as triton_grpc_aio
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.serverproc import Server, free_ports, running_server, wait_ready

TINY = "demo-tiny"
MULTI = "twohead"


def _two_input_model(path: Path) -> None:
    import keras

    keras.utils.set_random_seed(21)
    features = keras.Input((6,), name="features")
    ids = keras.Input((4,), dtype="int32", name="ids")
    h = keras.layers.Dense(8, activation="relu", name="dense")(features)
    e = keras.layers.Flatten(name="flat")(keras.layers.Embedding(10, 2, name="embed")(ids))
    z = keras.layers.Concatenate(name="cat")([h, e])
    z = keras.layers.Dense(8, activation="tanh", name="mix")(z)
    outputs = {
        "score": keras.layers.Dense(1, name="score_head")(z),
        "klass": keras.layers.Dense(3, name="klass_head")(z),
    }
    keras.Model({"features": features, "ids": ids}, outputs, name=MULTI).save(path)


@pytest.fixture(scope="module")
def grpc_port() -> int:
    """demo-tiny's gRPC port (the gRPC tests below)."""
    (port,) = free_ports(1)
    return port


@pytest.fixture(scope="module")
def servers(
    ray_address: str,
    demo_cache: Path,
    grpc_port: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Server]]:
    workdir = tmp_path_factory.mktemp("v2clients")
    model_path = workdir / f"{MULTI}.keras"
    common = ["--ray-address", ray_address, "--cache-dir", str(demo_cache),
              "--max-batch-size", "8", "--batch-timeout-ms", "2"]  # fmt: skip
    tiny_args = ["--model", TINY, "--stages", "2", *common, "--grpc-port", str(grpc_port)]
    with contextlib.ExitStack() as stack:
        tiny = stack.enter_context(running_server(tiny_args, workdir, ready=False))
        _two_input_model(model_path)  # while the first server loads
        multi = stack.enter_context(
            running_server(
                ["--model", str(model_path), "--stages", "1", *common], workdir, ready=False
            )
        )
        wait_ready(tiny)
        wait_ready(multi)
        yield {TINY: tiny, MULTI: multi}


def _client(server: Server) -> triton_http.InferenceServerClient:
    return triton_http.InferenceServerClient(url=server.url.removeprefix("http://"))


def _predict(server: Server, instances: list[object]) -> list[object]:
    r = httpx.post(f"{server.url}/predict", json={"instances": instances}, timeout=60)
    assert r.status_code == 200, r.text
    predictions: list[object] = r.json()["predictions"]
    return predictions


def test_health_metadata_and_config(servers: dict[str, Server]) -> None:
    client = _client(servers[TINY])
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(TINY) and client.is_model_ready(TINY, "1")
    assert not client.is_model_ready("nope")
    server_meta = client.get_server_metadata()
    assert server_meta["name"] == "shardserve"
    assert "binary_tensor_data" in server_meta["extensions"]
    meta = client.get_model_metadata(TINY)
    assert meta["name"] == TINY and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 8]}]
    assert [(o["datatype"], o["shape"]) for o in meta["outputs"]] == [("FP32", [-1, 4])]
    config = client.get_model_config(TINY)
    assert config["max_batch_size"] == 8
    assert config["input"] == [{"name": "features", "data_type": "TYPE_FP32", "dims": [8]}]
    assert config["dynamic_batching"] == {"max_queue_delay_microseconds": 2000}
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("nope")
    assert err.value.status() == "404"
    assert err.value.message() == "model 'nope' not found; this server serves 'demo-tiny'"


@pytest.mark.parametrize("binary", [False, True])
def test_infer_equals_predict(servers: dict[str, Server], binary: bool) -> None:
    server = servers[TINY]
    client = _client(server)
    output = client.get_model_metadata(TINY)["outputs"][0]["name"]
    rows = np.random.default_rng(7).normal(size=(5, 8)).astype(np.float32)
    inp = triton_http.InferInput("features", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows, binary_data=binary)
    result = client.infer(
        TINY,
        [inp],
        outputs=[triton_http.InferRequestedOutput(output, binary_data=binary)],
        request_id=f"tiny-{binary}",
    )
    got = result.as_numpy(output)
    want = np.asarray(_predict(server, rows.tolist()), np.float32)
    assert got.dtype == np.float32 and got.shape == (5, 4)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    response = result.get_response()
    assert response["id"] == f"tiny-{binary}" and response["model_name"] == TINY
    assert ("parameters" in response["outputs"][0]) is binary  # binary_data_size when binary


def test_bad_datatype_is_a_400_through_the_client(servers: dict[str, Server]) -> None:
    client = _client(servers[TINY])
    inp = triton_http.InferInput("features", [1, 8], "FP64")
    inp.set_data_from_numpy(np.zeros((1, 8), np.float64))
    with pytest.raises(InferenceServerException) as err:
        client.infer(TINY, [inp])
    assert err.value.status() == "400"
    assert err.value.message() == "input 'features' has datatype FP64; the model expects FP32"


def test_two_inputs_and_a_dict_output_in_binary(servers: dict[str, Server]) -> None:
    server = servers[MULTI]
    client = _client(server)
    meta = client.get_model_metadata(MULTI)
    assert {(t["name"], t["datatype"]) for t in meta["inputs"]} == {
        ("features", "FP32"),
        ("ids", "INT32"),
    }
    assert {(t["name"], tuple(t["shape"])) for t in meta["outputs"]} == {
        ("score", (-1, 1)),
        ("klass", (-1, 3)),
    }
    rng = np.random.default_rng(3)
    features = rng.normal(size=(4, 6)).astype(np.float32)
    ids = rng.integers(0, 10, size=(4, 4)).astype(np.int32)
    inputs = [
        triton_http.InferInput("ids", [4, 4], "INT32"),
        triton_http.InferInput("features", [4, 6], "FP32"),
    ]
    inputs[0].set_data_from_numpy(ids, binary_data=True)
    inputs[1].set_data_from_numpy(features, binary_data=True)
    everything = client.infer(MULTI, inputs)  # no outputs named: all of them, binary
    only_klass = client.infer(MULTI, inputs, outputs=[triton_http.InferRequestedOutput("klass")])
    rows = [{"features": f.tolist(), "ids": i.tolist()} for f, i in zip(features, ids, strict=True)]
    predictions = _predict(server, rows)
    for name, width in (("score", 1), ("klass", 3)):
        want = np.asarray([p[name] for p in predictions], np.float32)  # type: ignore[index]
        got = everything.as_numpy(name)
        assert got.shape == (4, width)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert [o["name"] for o in only_klass.get_response()["outputs"]] == ["klass"]
    np.testing.assert_array_equal(only_klass.as_numpy("klass"), everything.as_numpy("klass"))


# gRPC, on the same demo-tiny server.
@dataclass
class GrpcServer:
    http: Server
    grpc_url: str

    def client(self) -> triton_grpc.InferenceServerClient:
        return triton_grpc.InferenceServerClient(url=self.grpc_url)

    def predict(self, instances: list[object]) -> list[object]:
        r = httpx.post(f"{self.http.url}/predict", json={"instances": instances}, timeout=60)
        assert r.status_code == 200, r.text
        predictions: list[object] = r.json()["predictions"]
        return predictions


@pytest.fixture
def server(servers: dict[str, Server], grpc_port: int) -> GrpcServer:
    """The demo-tiny server of the HTTP tests above, through its gRPC port."""
    return GrpcServer(servers[TINY], f"127.0.0.1:{grpc_port}")


def test_grpc_health_metadata_and_config(server: GrpcServer) -> None:
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
        ("features", triton_grpc.model_config_pb2.TYPE_FP32, [8])
    ]
    assert [(o.data_type, list(o.dims)) for o in config.output] == [
        (triton_grpc.model_config_pb2.TYPE_FP32, [4])
    ]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    # The same answers as the HTTP routes'.
    http = httpx.get(f"{server.http.url}/v2/models/{TINY}", timeout=10).json()
    assert [o["name"] for o in http["outputs"]] == [o.name for o in meta.outputs]


def test_grpc_unknown_model_is_not_found(server: GrpcServer) -> None:
    client = server.client()
    for call in (client.is_model_ready, client.get_model_metadata, client.get_model_config):
        with pytest.raises(InferenceServerException) as err:
            call("nope")
        assert err.value.status() == "StatusCode.NOT_FOUND"
        assert err.value.message() == "model 'nope' not found; this server serves 'demo-tiny'"


def test_grpc_infer_equals_predict(server: GrpcServer) -> None:
    client = server.client()
    output = client.get_model_metadata(TINY).outputs[0].name
    rows = np.random.default_rng(7).normal(size=(5, 8)).astype(np.float32)
    inp = triton_grpc.InferInput("features", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows)
    result = client.infer(
        TINY, [inp], outputs=[triton_grpc.InferRequestedOutput(output)], request_id="tiny-1"
    )
    got = result.as_numpy(output)
    want = np.asarray(server.predict(rows.tolist()), np.float32)
    assert got.dtype == np.float32 and got.shape == (5, 4)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == ("tiny-1", TINY, "1")


def test_grpc_concurrent_single_rows_through_the_aio_client(server: GrpcServer) -> None:
    rows = np.random.default_rng(8).normal(size=(16, 8)).astype(np.float32)

    async def run() -> list[np.ndarray]:
        client = triton_grpc_aio.InferenceServerClient(url=server.grpc_url)
        try:

            async def one(row: np.ndarray) -> np.ndarray:
                inp = triton_grpc_aio.InferInput("features", [1, 8], "FP32")
                inp.set_data_from_numpy(row[None, :])
                result = await client.infer(TINY, [inp], client_timeout=60)
                return result.as_numpy(result.get_response().outputs[0].name)[0]

            return await asyncio.gather(*(one(row) for row in rows))
        finally:
            await client.close()

    got = np.stack(asyncio.run(run()))
    want = np.asarray(server.predict(rows.tolist()), np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_grpc_bad_datatype_is_invalid_argument(server: GrpcServer) -> None:
    client = server.client()
    inp = triton_grpc.InferInput("features", [1, 8], "FP64")
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
