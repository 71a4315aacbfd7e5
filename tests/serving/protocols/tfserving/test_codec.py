import numpy as np
import orjson
import pytest

from serving.errors import InvalidInputError
from serving.protocols.tfserving.codec import decode_predict, encode_predict
from shards.signature import ModelSignature, TensorSpec

SINGLE = ModelSignature(
    "m", (TensorSpec("x", (3,), "float32"),), (TensorSpec("y", (2,), "float32"),)
)
MULTI = ModelSignature(
    "m",
    (TensorSpec("ids", (None,), "int32"), TensorSpec("mask", (None,), "float32")),
    (TensorSpec("a", (1,), "float32"), TensorSpec("b", (), "float32")),
)


def body(obj: object) -> bytes:
    return orjson.dumps(obj)


def test_row_form_single_input() -> None:
    d = decode_predict(body({"instances": [[1, 2, 3], [4, 5, 6]]}), SINGLE)
    assert d.form == "instances" and d.rows == 2
    assert d.inputs["x"].dtype == np.float32
    np.testing.assert_array_equal(d.inputs["x"], [[1, 2, 3], [4, 5, 6]])


def test_columnar_and_keyed_forms() -> None:
    d = decode_predict(body({"inputs": {"x": [[1, 2, 3]]}}), SINGLE)
    assert d.form == "inputs" and d.rows == 1
    d = decode_predict(body({"instances": [{"x": [1, 2, 3]}]}), SINGLE)
    assert d.rows == 1
    d = decode_predict(body({"instances": [{"ids": [1, 2], "mask": [1, 0]}] * 3}), MULTI)
    assert d.inputs["ids"].dtype == np.int32 and d.inputs["ids"].shape == (3, 2)


@pytest.mark.parametrize(
    ("payload", "sig", "message"),
    [
        (b"{not json", SINGLE, "not valid JSON"),
        (body([1, 2]), SINGLE, "must be a JSON object"),
        (body({"rows": []}), SINGLE, "unknown key(s) ['rows']"),
        (body({"instances": [], "inputs": []}), SINGLE, "exactly one of"),
        (body({"instances": []}), SINGLE, '"instances" is empty'),
        (
            body({"instances": [[1, 2]]}),
            SINGLE,
            "input 'x' has shape (1, 2); expected (n, 3) float32",
        ),
        (body({"instances": [[1, 2, 3], [1, 2]]}), SINGLE, "ragged"),
        (body({"instances": [[1, "a", 3]]}), SINGLE, "holds strings"),
        (body({"instances": [[1, None, 3]]}), SINGLE, "null/non-numbers"),
        (body({"instances": [[True, False, True]]}), SINGLE, "holds booleans"),
        (body({"instances": [[0.5, 1, False]]}), SINGLE, "holds booleans"),
        (body({"instances": [{"z": [1, 2, 3]}]}), SINGLE, "unknown input(s) ['z']; expected ['x']"),
        (body({"instances": [{"ids": [1]}]}), MULTI, "missing input(s) ['mask']"),
        (body({"instances": [[1]]}), MULTI, "each instance must be an object"),
        (body({"instances": [{"ids": [1.5], "mask": [1]}]}), MULTI, "holds non-integers"),
        (body({"inputs": {"ids": [[1]], "mask": [[1], [1]]}}), MULTI, "different row counts"),
        (body({"inputs": {"ids": [[2**40]], "mask": [[1]]}}), MULTI, "outside the range of int32"),
    ],
)
def test_bad_input_is_named(payload: bytes, sig: ModelSignature, message: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        decode_predict(payload, sig)
    assert message in info.value.message


def test_encode_forms() -> None:
    y = np.array([[1.5, 2.0], [3.0, 4.0]], dtype=np.float32)
    assert orjson.loads(encode_predict({"y": y}, SINGLE, "instances")) == {
        "predictions": [[1.5, 2.0], [3.0, 4.0]]
    }
    assert orjson.loads(encode_predict({"y": y}, SINGLE, "inputs")) == {
        "outputs": [[1.5, 2.0], [3.0, 4.0]]
    }
    outs = {"a": np.array([[1.0], [2.0]], np.float32), "b": np.array([5.0, 6.0], np.float32)}
    assert orjson.loads(encode_predict(outs, MULTI, "instances")) == {
        "predictions": [{"a": [1.0], "b": 5.0}, {"a": [2.0], "b": 6.0}]
    }
    assert orjson.loads(encode_predict(outs, MULTI, "inputs")) == {
        "outputs": {"a": [[1.0], [2.0]], "b": [5.0, 6.0]}
    }
