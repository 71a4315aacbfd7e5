"""The V2 HTTP routes of a real server, checked with Triton's own client (``tritonclient.http``).

Two servers on the session's Ray, started side by side: ``demo-tiny`` in 2 stages, and a Keras
model with two named inputs (one of them int32 ids) and a dict of two outputs, in 1 stage (the
pipeline's own tests cut such models; one stage keeps this module near a minute).
Every answer is compared with ``/predict``'s on the same rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.serverproc import Server, running_server, wait_ready

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
def servers(
    ray_address: str, demo_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    workdir = tmp_path_factory.mktemp("v2http")
    model_path = workdir / f"{MULTI}.keras"
    common = ["--ray-address", ray_address, "--cache-dir", str(demo_cache),
              "--max-batch-size", "8", "--batch-timeout-ms", "2"]  # fmt: skip
    with contextlib.ExitStack() as stack:
        tiny = stack.enter_context(
            running_server(["--model", TINY, "--stages", "2", *common], workdir, ready=False)
        )
        _two_input_model(model_path)  # while the first server loads
        multi = stack.enter_context(
            running_server(
                ["--model", str(model_path), "--stages", "1", *common], workdir, ready=False
            )
        )
        wait_ready(tiny)
        wait_ready(multi)
        yield {TINY: tiny, MULTI: multi}


def _client(server: Server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=server.url.removeprefix("http://"))


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
    inp = triton.InferInput("features", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows, binary_data=binary)
    result = client.infer(
        TINY,
        [inp],
        outputs=[triton.InferRequestedOutput(output, binary_data=binary)],
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
    inp = triton.InferInput("features", [1, 8], "FP64")
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
        triton.InferInput("ids", [4, 4], "INT32"),
        triton.InferInput("features", [4, 6], "FP32"),
    ]
    inputs[0].set_data_from_numpy(ids, binary_data=True)
    inputs[1].set_data_from_numpy(features, binary_data=True)
    everything = client.infer(MULTI, inputs)  # no outputs named: all of them, binary
    only_klass = client.infer(MULTI, inputs, outputs=[triton.InferRequestedOutput("klass")])
    rows = [{"features": f.tolist(), "ids": i.tolist()} for f, i in zip(features, ids, strict=True)]
    predictions = _predict(server, rows)
    for name, width in (("score", 1), ("klass", 3)):
        want = np.asarray([p[name] for p in predictions], np.float32)  # type: ignore[index]
        got = everything.as_numpy(name)
        assert got.shape == (4, width)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert [o["name"] for o in only_klass.get_response()["outputs"]] == ["klass"]
    np.testing.assert_array_equal(only_klass.as_numpy("klass"), everything.as_numpy("klass"))
