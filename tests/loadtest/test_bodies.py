"""The Locust user's request bodies, one per protocol, decode to the rows they were made from."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loadtest.bodies import encode_body, make_bodies, random_inputs, request_path
from serving.protocols.tfserving.codec import decode_predict
from shards.signature import ModelSignature, TensorSpec

SIGNATURE = ModelSignature(
    name="two",
    inputs=(TensorSpec("x", (3,), "float32"), TensorSpec("ids", (2,), "int64")),
    outputs=(TensorSpec("y", (1,), "float32"),),
)
METADATA = SIGNATURE.to_json()


def _inputs() -> dict[str, np.ndarray]:
    return random_inputs(METADATA, 2, np.random.default_rng(3))


def test_tfserving_bodies_decode_to_the_same_rows() -> None:
    inputs = _inputs()
    body, headers = encode_body(inputs, "tfserving")
    decoded = decode_predict(body, SIGNATURE)
    assert headers == {"Content-Type": "application/json"}
    for name, value in inputs.items():
        np.testing.assert_array_equal(decoded.inputs[name], value)


def test_v2_json_bodies_carry_flat_data_and_the_datatypes() -> None:
    inputs = _inputs()
    body, _ = encode_body(inputs, "v2-json")
    tensors = {t["name"]: t for t in json.loads(body)["inputs"]}
    assert tensors["x"]["datatype"] == "FP32" and tensors["ids"]["datatype"] == "INT64"
    assert tensors["x"]["shape"] == [2, 3]
    np.testing.assert_allclose(tensors["x"]["data"], inputs["x"].ravel())


def test_v2_binary_bodies_put_the_raw_tensors_after_the_json_header() -> None:
    inputs = _inputs()
    body, headers = encode_body(inputs, "v2-binary")
    length = int(headers["Inference-Header-Content-Length"])
    header = json.loads(body[:length])
    assert header["parameters"] == {"binary_data_output": True}
    offset = length
    for tensor in header["inputs"]:
        size = tensor["parameters"]["binary_data_size"]
        value = inputs[tensor["name"]]
        got = np.frombuffer(body[offset : offset + size], dtype=value.dtype).reshape(value.shape)
        np.testing.assert_array_equal(got, value)
        offset += size
    assert offset == len(body)


def test_paths_and_bad_protocol() -> None:
    assert request_path("tfserving", "m") == "/predict"
    assert request_path("v2-binary", "m") == "/v2/models/m/infer"
    with pytest.raises(ValueError, match="--protocol must be one of"):
        make_bodies(METADATA, 1, 1, 0, "grpc")
