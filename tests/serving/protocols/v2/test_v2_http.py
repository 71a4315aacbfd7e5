"""The Open Inference Protocol (KServe V2) routes in process, with the fake runner."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import ml_dtypes
import numpy as np
import orjson
import pytest

from serving.errors import InvalidInputError
from serving.protocols.v2.datatypes import TO_NUMPY
from serving.protocols.v2.tensors import decode_tensor
from shards.signature import ModelSignature, TensorSpec
from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner, expected_outputs
from tests.metrics_text import metric
from tests.serving.served_app import row, serve

INFER = "/v2/models/fake/infer"
MULTI = ModelSignature(
    "multi",
    inputs=(TensorSpec("a", (3,), "float32"), TensorSpec("b", (2, 2), "int32")),
    outputs=(TensorSpec("score", (1,), "float32"), TensorSpec("klass", (3,), "float64")),
)


def binary_body(header: dict[str, Any], *tensors: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """A binary-extension body: the JSON header, then each tensor's bytes in order."""
    head = orjson.dumps(header)
    body = head + b"".join(t.tobytes() for t in tensors)
    return body, {"Inference-Header-Content-Length": str(len(head))}


def binary_input(name: str, arr: np.ndarray, datatype: str) -> dict[str, Any]:
    return {
        "name": name,
        "shape": list(arr.shape),
        "datatype": datatype,
        "parameters": {"binary_data_size": arr.nbytes},
    }


def split_response(r: httpx.Response) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The JSON header and the binary outputs of a response, read as the spec lays them out."""
    length = int(r.headers["inference-header-content-length"])
    header = orjson.loads(r.content[:length])
    binary, offset, arrays = r.content[length:], 0, {}
    for out in header["outputs"]:
        size = out.get("parameters", {}).get("binary_data_size")
        if size is not None:
            dtype = np.dtype(TO_NUMPY[out["datatype"]])
            arrays[out["name"]] = np.frombuffer(binary[offset : offset + size], dtype).reshape(
                out["shape"]
            )
            offset += size
    assert offset == len(binary)
    return header, arrays


async def test_server_metadata_health_and_model_routes() -> None:
    async with serve(FakeRunner(), batch_timeout_ms=2.5, max_batch_size=8) as client:
        meta = (await client.get("/v2")).json()
        live = await client.get("/v2/health/live")
        ready = await client.get("/v2/health/ready")
        model = await client.get("/v2/models/fake")
        versioned = await client.get("/v2/models/fake/versions/1")
        model_ready = await client.get("/v2/models/fake/ready")
        version_ready = await client.get("/v2/models/fake/versions/1/ready")
        config = await client.get("/v2/models/fake/config")
    assert meta["name"] == "shardserve" and "binary_tensor_data" in meta["extensions"]
    assert isinstance(meta["version"], str) and meta["version"]
    assert (live.status_code, live.json()) == (200, {"live": True})
    assert (ready.status_code, ready.json()) == (200, {"ready": True})
    assert model.json() == {
        "name": "fake",
        "versions": ["1"],
        "platform": "tensorflow_keras",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
    }
    assert versioned.json() == model.json()
    assert (model_ready.status_code, model_ready.json()) == (200, {"name": "fake", "ready": True})
    assert version_ready.status_code == 200
    assert config.json() == {
        "name": "fake",
        "platform": "tensorflow_keras",
        "backend": "shardserve",
        "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [2]}],
        "dynamic_batching": {"max_queue_delay_microseconds": 2500},
    }


async def test_free_dimensions_are_minus_one_in_metadata_and_config() -> None:
    sig = ModelSignature(
        "seq", (TensorSpec("tokens", (None, 8), "int64"),), (TensorSpec("y", (2,), "float16"),)
    )
    async with serve(FakeRunner(sig), batch_timeout_ms="auto") as client:
        model = (await client.get("/v2/models/fake")).json()
        config = (await client.get("/v2/models/fake/config")).json()
    assert model["inputs"] == [{"name": "tokens", "datatype": "INT64", "shape": [-1, -1, 8]}]
    assert model["outputs"] == [{"name": "y", "datatype": "FP16", "shape": [-1, 2]}]
    assert config["input"] == [{"name": "tokens", "data_type": "TYPE_INT64", "dims": [-1, 8]}]
    assert config["dynamic_batching"] == {}  # the adaptive wait has no fixed delay


async def test_not_ready_while_loading() -> None:
    release = asyncio.Event()

    async def slow(_: Any) -> FakeRunner:
        await release.wait()
        return FakeRunner()

    from asgi_lifespan import LifespanManager

    from serving.server.app import create_app
    from serving.settings.config import Settings

    app = create_app(Settings(model="fake", batch_timeout_ms=0), slow)
    async with LifespanManager(app) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/v2/health/live")).status_code == 200
            ready = await client.get("/v2/health/ready")
            model_ready = await client.get("/v2/models/fake/ready")
            meta = await client.get("/v2/models/fake")
            infer = await client.post(INFER, json={"inputs": []})
            release.set()
            await app.state.shardserve.model().until_ready()
            assert (await client.get("/v2/health/ready")).status_code == 200
    assert (ready.status_code, ready.json()) == (503, {"ready": False})
    assert (model_ready.status_code, model_ready.json()) == (503, {"name": "fake", "ready": False})
    assert meta.status_code == 503 and "still loading" in assert_clean_error(meta)
    assert infer.status_code == 503 and "still loading" in assert_clean_error(infer)


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/other",
        "/v2/models/other/ready",
        "/v2/models/other/config",
        "/v2/models/fake/versions/2",
        "/v2/models/fake/versions/2/ready",
        "/v2/models/fake/versions/2/config",
    ],
)
async def test_unknown_model_or_version_is_404(path: str) -> None:
    async with serve(FakeRunner(), batch_timeout_ms=0) as client:
        r = await client.get(path)
    assert r.status_code == 404
    message = assert_clean_error(r)
    assert ("model 'other' not found" in message) or ("has no version '2'" in message)


async def test_infer_unknown_model_or_version_is_404() -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": row(1)}]}
    async with serve(FakeRunner(), batch_timeout_ms=0) as client:
        other = await client.post("/v2/models/other/infer", json=body)
        version = await client.post("/v2/models/fake/versions/7/infer", json=body)
        ok = await client.post("/v2/models/fake/versions/1/infer", json=body)
    assert other.status_code == 404
    assert assert_clean_error(other) == "model 'other' not found; this server serves 'fake'"
    assert version.status_code == 404
    assert assert_clean_error(version) == "model 'fake' has no version '7'; its versions: ['1']"
    assert ok.status_code == 200


async def test_json_infer_equals_predict() -> None:
    rows = [row(1), row(2), row(5)]
    async with serve(FakeRunner(), batch_timeout_ms=0) as client:
        predict = await client.post("/predict", json={"instances": rows})
        flat = await client.post(
            INFER,
            json={
                "id": "req-42",
                "inputs": [
                    {
                        "name": "x",
                        "shape": [3, 4],
                        "datatype": "FP32",
                        "data": [v for r in rows for v in r],
                    }
                ],
            },
        )
        nested = await client.post(
            INFER,
            json={"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": rows}]},
        )
    assert flat.status_code == 200 and flat.headers["content-type"] == "application/json"
    assert "inference-header-content-length" not in flat.headers
    want = predict.json()["predictions"]
    assert flat.json() == {
        "model_name": "fake",
        "model_version": "1",
        "id": "req-42",
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [3, 2], "data": [v for r in want for v in r]}
        ],
    }
    assert "id" not in nested.json()
    assert nested.json()["outputs"] == flat.json()["outputs"]


async def test_binary_in_binary_out_equals_predict() -> None:
    x = np.array([row(3), row(4)], np.float32)
    body, headers = binary_body(
        {
            "id": "bin",
            "inputs": [binary_input("x", x, "FP32")],
            "parameters": {"binary_data_output": True},
        },
        x,
    )
    runner = FakeRunner()
    async with serve(runner, batch_timeout_ms=0) as client:
        predict = await client.post("/predict", json={"instances": x.tolist()})
        runner.batches.clear()
        r = await client.post(INFER, content=body, headers=headers)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/octet-stream"
    header, arrays = split_response(r)
    assert header["id"] == "bin"
    assert header["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [2, 2], "parameters": {"binary_data_size": 16}}
    ]
    np.testing.assert_array_equal(
        arrays["y"], np.asarray(predict.json()["predictions"], np.float32)
    )
    np.testing.assert_array_equal(runner.batches[0]["x"][:2], x)  # bit-exact to the model


async def test_outputs_subset_order_and_binary_choice() -> None:
    a = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    b = np.array([[[1, 2], [3, 4]], [[5, 6], [7, 8]]], np.int32)
    want = expected_outputs({"a": a, "b": b}, MULTI)
    async with serve(FakeRunner(MULTI), batch_timeout_ms=0) as client:
        one = await client.post(
            INFER,
            json={
                "inputs": [
                    {"name": "b", "shape": [2, 2, 2], "datatype": "INT32", "data": b.tolist()},
                    {"name": "a", "shape": [2, 3], "datatype": "FP32", "data": a.ravel().tolist()},
                ],
                "outputs": [{"name": "klass"}],
            },
        )
        body, headers = binary_body(
            {
                "inputs": [binary_input("a", a, "FP32"), binary_input("b", b, "INT32")],
                "outputs": [
                    {"name": "klass", "parameters": {"binary_data": True}},
                    {"name": "score", "parameters": {"binary_data": False}},
                ],
                "parameters": {"binary_data_output": True},
            },
            a,
            b,
        )
        mixed = await client.post(INFER, content=body, headers=headers)
    assert [o["name"] for o in one.json()["outputs"]] == ["klass"]
    klass = one.json()["outputs"][0]
    assert (klass["datatype"], klass["shape"]) == ("FP64", [2, 3])
    np.testing.assert_array_equal(klass["data"], want["klass"].ravel())
    header, arrays = split_response(mixed)
    assert [o["name"] for o in header["outputs"]] == ["klass", "score"]
    np.testing.assert_array_equal(arrays["klass"], want["klass"])
    assert header["outputs"][1]["data"] == want["score"].ravel().tolist()
    assert "parameters" not in header["outputs"][1]


@pytest.mark.parametrize(
    "datatype", ["BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64",
                 "FP16", "FP32", "FP64", "BF16"],
)  # fmt: skip
async def test_each_datatype_in_binary(datatype: str) -> None:
    dtype = np.dtype(ml_dtypes.bfloat16) if datatype == "BF16" else np.dtype(TO_NUMPY[datatype])
    sig = ModelSignature(
        "typed", (TensorSpec("x", (3,), dtype.name),), (TensorSpec("y", (2,), "float32"),)
    )
    x = (np.arange(6).reshape(2, 3) % 2 == 1) if datatype == "BOOL" else np.arange(6).reshape(2, 3)
    x = x.astype(dtype)
    body, headers = binary_body({"inputs": [binary_input("x", x, datatype)]}, x)
    runner = FakeRunner(sig)
    async with serve(runner, batch_timeout_ms=0) as client:
        runner.batches.clear()
        r = await client.post(INFER, content=body, headers=headers)
    assert r.status_code == 200, r.text
    got = runner.batches[0]["x"][:2]
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, x)
    np.testing.assert_array_equal(
        r.json()["outputs"][0]["data"], expected_outputs({"x": x}, sig)["y"].ravel()
    )


@pytest.mark.parametrize(
    ("datatype", "data"),
    [("BOOL", [True, False, True]), ("INT8", [-128, 0, 127]), ("UINT64", [0, 1, 2**64 - 1]),
     ("FP16", [0.5, 1.5, -2.0]), ("FP64", [0.1, 1e300, -3.0])],
)  # fmt: skip
async def test_datatypes_in_json(datatype: str, data: list[Any]) -> None:
    dtype = np.dtype(TO_NUMPY[datatype])
    sig = ModelSignature(
        "typed", (TensorSpec("x", (3,), dtype.name),), (TensorSpec("y", (2,), "float64"),)
    )
    runner = FakeRunner(sig)
    async with serve(runner, batch_timeout_ms=0) as client:
        runner.batches.clear()
        r = await client.post(
            INFER,
            json={"inputs": [{"name": "x", "shape": [1, 3], "datatype": datatype, "data": data}]},
        )
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(runner.batches[0]["x"][0], np.array(data, dtype))


def test_binary_input_is_a_view_of_the_request_bytes() -> None:
    spec = TensorSpec("x", (4,), "float32")
    raw = np.arange(8, dtype="<f4").tobytes()
    arr = decode_tensor("x", "FP32", [2, 4], memoryview(raw)[0:32], spec)
    assert np.shares_memory(arr, np.frombuffer(raw, np.uint8))  # no copy
    assert not arr.flags.writeable
    np.testing.assert_array_equal(arr, np.arange(8, dtype=np.float32).reshape(2, 4))


def test_a_repeated_binary_header_reads_each_request_s_own_bytes() -> None:
    """The layout a binary header decides is kept; the tensors are still each body's own,
    and a body whose byte count no longer fits that header is refused as before."""
    from serving.protocols.v2.infer_body import parse_infer

    sig = MULTI
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(8, dtype=np.int32).reshape(2, 2, 2)
    header = {"inputs": [binary_input("a", a, "FP32"), binary_input("b", b, "INT32")]}
    calls = []
    for k in range(3):
        body, headers = binary_body(header, a + k, b * k)
        calls.append(parse_infer(body, headers["Inference-Header-Content-Length"], sig))
        assert np.shares_memory(calls[-1].inputs["a"], np.frombuffer(body, np.uint8))
    for k, call in enumerate(calls):
        np.testing.assert_array_equal(call.inputs["a"], a + k)
        np.testing.assert_array_equal(call.inputs["b"], b * k)
        assert call.inputs["b"].dtype == np.int32 and call.inputs["b"].shape == (2, 2, 2)
    body, headers = binary_body({**header, "parameters": {"timeout": -1}}, a, b)
    with pytest.raises(InvalidInputError, match='"timeout" must be a positive number of micro'):
        parse_infer(body, headers["Inference-Header-Content-Length"], sig)
    body, headers = binary_body(header, a, b)
    with pytest.raises(InvalidInputError, match="bytes of binary data are left"):
        parse_infer(body[:-8], headers["Inference-Header-Content-Length"], sig)
    with pytest.raises(InvalidInputError, match="that no input's binary_data_size accounts"):
        parse_infer(body + b"\0" * 8, headers["Inference-Header-Content-Length"], sig)


@pytest.mark.parametrize(
    ("dtype", "data", "message"),
    [
        ("int64", [-1, 2**63], "outside the range of INT64"),
        ("uint64", [-1, 2**63], "outside the range of UINT64"),
        ("uint8", [0, 256], "outside the range of UINT8"),
        ("int32", [1, 2.5], "holds non-integers"),
        ("int64", [2**63, 0.5], "holds non-integers"),
        ("bool", [1, 0], "its data must be true/false"),
    ],
)
def test_json_integers_are_exact_or_refused(dtype: str, data: list[Any], message: str) -> None:
    spec = TensorSpec("x", (2,), dtype)
    datatype = {"int64": "INT64", "uint64": "UINT64", "uint8": "UINT8", "int32": "INT32"}.get(
        dtype, "BOOL"
    )
    with pytest.raises(InvalidInputError, match=message):
        decode_tensor("x", datatype, [1, 2], data, spec)


def test_json_uint64_past_int64_is_exact() -> None:
    arr = decode_tensor("x", "UINT64", [1, 2], [2**64 - 1, 1], TensorSpec("x", (2,), "uint64"))
    assert arr.dtype == np.uint64 and arr.tolist() == [[2**64 - 1, 1]]


def test_binary_bool_must_be_zero_or_one() -> None:
    spec = TensorSpec("x", (2,), "bool")
    with pytest.raises(InvalidInputError, match="holds bytes other than 0 and 1"):
        decode_tensor("x", "BOOL", [1, 2], b"\x01\x02", spec)


X4 = {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            {"inputs": [{**X4, "datatype": "FP64"}]},
            "input 'x' has datatype FP64; the model expects FP32",
        ),
        (
            {"inputs": [{**X4, "datatype": "FLOAT"}]},
            "input 'x' has datatype 'FLOAT', which is not a datatype of the protocol; "
            "the model expects FP32",
        ),
        (
            {"inputs": [{**X4, "shape": [1, 3]}]},
            "input 'x' has shape [1, 3]; the model expects [-1, 4]",
        ),
        ({"inputs": [{**X4, "shape": [4]}]}, "input 'x' has shape [4]; the model expects [-1, 4]"),
        ({"inputs": [{**X4, "shape": [0, 4], "data": []}]}, "input 'x' has shape [0, 4]: no rows"),
        ({"inputs": [{**X4, "shape": [1, "4"]}]}, "a shape is a list of integers >= 0"),
        ({"inputs": [{**X4, "data": [1, 2, 3]}]}, "input 'x' has 3 values; shape [1, 4] holds 4"),
        ({"inputs": [{**X4, "data": [1, 2, 3, "4"]}]}, "input 'x' holds strings"),
        ({"inputs": [{**X4, "data": [1, 2, None, 4]}]}, "input 'x' holds null"),
        ({"inputs": [{**X4, "data": [[1, 2], [3]]}]}, "ragged"),
        ({"inputs": [{**X4, "data": [True, False, True, True]}]}, "input 'x' holds booleans"),
        ({"inputs": [{**X4, "data": 7}]}, "input 'x' has \"data\" of type int"),
        (
            {"inputs": [{k: v for k, v in X4.items() if k != "data"}]},
            'has neither "data" nor binary_data_size',
        ),
        ({"inputs": [X4, X4]}, "input 'x' is given twice"),
        ({"inputs": [{**X4, "name": "z"}]}, "unknown input 'z'; the model's inputs are ['x']"),
        ({"inputs": []}, '"inputs" must be a non-empty list'),
        ({"instances": [[1, 2, 3, 4]]}, '"inputs" must be a non-empty list'),
        (
            {"inputs": [X4], "outputs": [{"name": "q"}]},
            "unknown output 'q'; the model's outputs are ['y']",
        ),
        (
            {"inputs": [X4], "outputs": [{"name": "y"}, {"name": "y"}]},
            "output 'y' is asked for twice",
        ),
        (
            {"inputs": [X4], "outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}]},
            '"binary_data" must be true or false',
        ),
        ({"inputs": [X4], "id": 5}, '"id" must be a string, got int'),
        (
            {"inputs": [X4], "parameters": {"timeout": "soon"}},
            'parameter "timeout" is in microseconds',
        ),
        (
            {"inputs": [X4], "parameters": {"timeout": -5}},
            'parameter "timeout" must be a positive number of microseconds, got -5; leave it '
            "out for the server's deadline (request_timeout_ms)",
        ),
        (
            {"inputs": [X4], "parameters": {"timeout": 0}},
            'parameter "timeout" must be a positive number of microseconds, got 0',
        ),
        (
            {"inputs": [{**X4, "datatype": "BF16"}]},
            "input 'x' has datatype BF16; the model expects FP32",
        ),
        (
            {"inputs": [{**X4, "parameters": {"shared_memory_region": "r"}}]},
            "uses shared memory, which this server does not serve",
        ),
        ([1, 2], "must be a JSON object"),
    ],
)
async def test_bad_json_request_is_400_with_reason(payload: Any, message: str) -> None:
    async with serve(FakeRunner(), batch_timeout_ms=0) as client:
        r = await client.post(INFER, content=orjson.dumps(payload))
    assert r.status_code == 400
    assert message in assert_clean_error(r)


async def test_multi_input_errors() -> None:
    a = {"name": "a", "shape": [2, 3], "datatype": "FP32", "data": [0.0] * 6}
    b = {"name": "b", "shape": [1, 2, 2], "datatype": "INT32", "data": [1, 2, 3, 4]}
    async with serve(FakeRunner(MULTI), batch_timeout_ms=0) as client:
        missing = await client.post(INFER, json={"inputs": [a]})
        rows = await client.post(INFER, json={"inputs": [a, b]})
        floats = await client.post(INFER, json={"inputs": [a, {**b, "data": [1.5, 2, 3, 4]}]})
        big = await client.post(INFER, json={"inputs": [a, {**b, "data": [2**31, 2, 3, 4]}]})
    assert (
        assert_clean_error(missing) == "missing input(s) ['b']; the model's inputs are ['a', 'b']"
    )
    assert (
        assert_clean_error(rows)
        == "inputs have different row counts {'a': 2, 'b': 1}; all must be equal"
    )
    assert assert_clean_error(floats) == "input 'b' holds non-integers; expected INT32 values"
    assert assert_clean_error(big) == "input 'b' holds values outside the range of INT32"
    assert {missing.status_code, rows.status_code, floats.status_code, big.status_code} == {400}


def _x_body(size: int | None = None, extra: bytes = b"") -> tuple[bytes, dict[str, str]]:
    x = np.array([row(1)], np.float32)
    entry = binary_input("x", x, "FP32")
    if size is not None:
        entry["parameters"]["binary_data_size"] = size
    body, headers = binary_body({"inputs": [entry]}, x)
    return body + extra, headers


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: _x_body(size=12), "input 'x' has 12 bytes of data; shape [1, 4] of FP32 needs 16 bytes"),
        (lambda: _x_body(size=20), "input 'x' has binary_data_size 20 but only 16 bytes"),
        (lambda: _x_body(extra=b"\0\0"), "the body has 2 bytes after the JSON header that no input"),
        (
            lambda: (_x_body()[0], {"Inference-Header-Content-Length": "9999"}),
            "header Inference-Header-Content-Length is 9999 but the body has only",
        ),
        (  # past 4,300 digits int() raises: refused from its length, a 400 not a 500
            lambda: (_x_body()[0], {"Inference-Header-Content-Length": "9" * 5000}),
            "header Inference-Header-Content-Length is 99999999",
        ),
        (
            lambda: (_x_body()[0], {"Inference-Header-Content-Length": "0" * 5000 + "10"}),
            "but the body has only",
        ),
        (
            lambda: (_x_body()[0], {"Inference-Header-Content-Length": "-3"}),
            "header Inference-Header-Content-Length must be the JSON header's length in bytes",
        ),
        (
            lambda: (_x_body()[0], {"Inference-Header-Content-Length": "10"}),
            "the inference request is not valid JSON",
        ),
        (lambda: (_x_body()[0], {}), "the inference request is not valid JSON"),
        (
            lambda: binary_body(
                {"inputs": [{**binary_input("x", np.zeros((1, 4), np.float32), "FP32"), "data": [1]}]},
                np.zeros((1, 4), np.float32),
            ),
            'has both "data" and binary_data_size',
        ),
        (
            lambda: binary_body(
                {"inputs": [binary_input("x", np.zeros((1, 4), np.float32), "FP32")],
                 "outputs": [{"name": "y", "parameters": {"classification": 2}}]},
                np.zeros((1, 4), np.float32),
            ),
            "classification and shared memory are not served",
        ),
    ],
)  # fmt: skip
async def test_bad_binary_request_is_400_with_reason(make: Any, message: str) -> None:
    body, headers = make()
    async with serve(FakeRunner(), batch_timeout_ms=0) as client:
        r = await client.post(INFER, content=body, headers=headers)
    assert r.status_code == 400
    assert message in assert_clean_error(r)


async def test_bf16_needs_a_bf16_model_and_binary_data() -> None:
    bf16 = np.dtype(ml_dtypes.bfloat16)
    sig = ModelSignature(
        "half", (TensorSpec("x", (2,), "bfloat16"),), (TensorSpec("y", (2,), "bfloat16"),)
    )
    x = np.array([[1.5, -2.0]], bf16)
    body, headers = binary_body({"inputs": [binary_input("x", x, "BF16")]}, x)
    async with serve(FakeRunner(sig), batch_timeout_ms=0) as client:
        as_json = await client.post(
            INFER,
            json={
                "inputs": [{"name": "x", "shape": [1, 2], "datatype": "BF16", "data": [1.5, -2.0]}]
            },
        )
        json_out = await client.post(INFER, content=body, headers=headers)
        body2, headers2 = binary_body(
            {"inputs": [binary_input("x", x, "BF16")], "parameters": {"binary_data_output": True}},
            x,
        )
        ok = await client.post(INFER, content=body2, headers=headers2)
    async with serve(FakeRunner(), batch_timeout_ms=0) as client:
        xf = np.zeros((1, 4), bf16)
        body3, headers3 = binary_body({"inputs": [binary_input("x", xf, "BF16")]}, xf)
        fp32_model = await client.post(INFER, content=body3, headers=headers3)
    assert as_json.status_code == 400
    assert (
        "input 'x' is BF16, which JSON cannot carry; send it as binary data"
        in assert_clean_error(as_json)
    )
    assert json_out.status_code == 400
    assert "output 'y' is BF16, which JSON cannot carry" in assert_clean_error(json_out)
    assert ok.status_code == 200
    length = int(ok.headers["inference-header-content-length"])
    assert orjson.loads(ok.content[:length])["outputs"][0]["datatype"] == "BF16"
    y = np.frombuffer(ok.content[length:], bf16).reshape(1, 2)
    np.testing.assert_array_equal(y, expected_outputs({"x": x}, sig)["y"])
    assert fp32_model.status_code == 400
    assert assert_clean_error(fp32_model) == "input 'x' has datatype BF16; the model expects FP32"


async def test_admission_limits_metrics_and_request_id() -> None:
    big = {"inputs": [{"name": "x", "shape": [300, 4], "datatype": "FP32", "data": [0.5] * 1200}]}
    ok = {"inputs": [X4]}
    async with serve(FakeRunner(), batch_timeout_ms=0, max_body_bytes=4096) as client:
        too_big = await client.post(INFER, json=big)
        gzip = await client.post(INFER, json=ok, headers={"Content-Encoding": "gzip"})
        bad_deadline = await client.post(INFER, json=ok, headers={"X-Request-Timeout-Ms": "soon"})
        fine = await client.post(INFER, json=ok, headers={"X-Request-Id": "v2-job-1"})
        metrics = (await client.get("/metrics")).text
    assert too_big.status_code == 413 and "over the limit of 4096 bytes" in assert_clean_error(
        too_big
    )
    assert gzip.status_code == 400
    assert "Content-Encoding 'gzip' is not served" in assert_clean_error(gzip)
    assert bad_deadline.status_code == 400 and "X-Request-Timeout-Ms" in assert_clean_error(
        bad_deadline
    )
    assert fine.headers["x-request-id"] == "v2-job-1"
    assert metric(metrics, "shardserve_rejects_total", reason="invalid_input") == 3.0
    assert metric(metrics, "shardserve_request_latency_seconds_count", status="200") == 1.0
    assert metric(metrics, "shardserve_request_latency_seconds_count", status="400") == 2.0


async def test_deadline_from_the_timeout_parameter() -> None:
    gate = asyncio.Event()
    runner = FakeRunner()
    async with serve(runner, batch_timeout_ms=0, max_inflight_batches=1) as client:
        runner.gate = gate
        first = asyncio.create_task(client.post(INFER, json={"inputs": [X4]}))
        await runner.wait_started(2)  # the only in-flight slot is held; the next row must wait
        late = await client.post(INFER, json={"inputs": [X4], "parameters": {"timeout": 20_000}})
        gate.set()
        assert (await first).status_code == 200
    assert late.status_code == 504
    assert "deadline" in assert_clean_error(late)


async def test_openapi_documents_the_v2_bodies() -> None:
    async with serve(FakeRunner(), batch_timeout_ms=0) as client:
        doc = (await client.get("/openapi.json")).json()
    infer = doc["paths"]["/v2/models/{name}/infer"]["post"]
    request_schema = infer["requestBody"]["content"]["application/json"]["schema"]
    assert request_schema["required"] == ["inputs"]
    # Once the model is loaded, the body is the served model's (serving/openapi/v2.py, checked in
    # tests/serving/openapi/test_apidoc.py); the binary extension is described in words.
    assert "Inference-Header-Content-Length" in request_schema["description"]
    assert list(infer["requestBody"]["content"]) == ["application/json"]
    assert {"200", "400", "404", "413", "503", "504"} <= set(infer["responses"])
    assert "/v2/models/{name}/versions/{version}/infer" in doc["paths"]
    meta = doc["paths"]["/v2/models/{name}"]["get"]["responses"]["200"]
    assert meta["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/V2ModelMetadata"
    }
