import numpy as np
import orjson
import pytest

from serving.errors import InvalidInputError
from serving.protocols.tfserving.codec import decode_predict, encode_predict, encode_rows
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
        (
            body({"instances": [[1, 2, 3], [1, 2]]}),
            SINGLE,
            "instance 1 of input 'x' has shape (2,); the model takes (n, 3) float32: every row "
            "the same shape",
        ),
        (body({"inputs": [[1, 2, 3], [1, 2]]}), SINGLE, "input 'x' is ragged"),
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


TOKENS = ModelSignature(
    "m", (TensorSpec("ids", (None,), "int32"),), (TensorSpec("y", (4,), "float32"),)
)
GRID = ModelSignature(
    "m", (TensorSpec("x", (None, 2), "float32"),), (TensorSpec("y", (2,), "float32"),)
)
MIXED = ModelSignature(
    "m",
    (TensorSpec("ids", (None,), "int32"), TensorSpec("bias", (2,), "float32")),
    (TensorSpec("y", (None,), "float32"),),
)


def test_rectangular_instances_of_unknown_length_stay_stacked() -> None:
    d = decode_predict(body({"instances": [[1, 2, 3], [4, 5, 6]]}), TOKENS)
    assert d.ragged is None and d.inputs["ids"].shape == (2, 3)


def test_ragged_instances_decode_to_rows_where_the_model_takes_any_length() -> None:
    d = decode_predict(body({"instances": [[1, 2, 3], [4], [5, 6]]}), TOKENS)
    assert d.form == "instances" and d.rows == 3 and d.inputs == {}
    assert d.ragged is not None
    assert [r["ids"].tolist() for r in d.ragged] == [[1, 2, 3], [4], [5, 6]]
    assert all(r["ids"].dtype == np.int32 and r["ids"].flags.c_contiguous for r in d.ragged)
    d = decode_predict(body({"instances": [[[1, 2]], [[3, 4], [5, 6]]]}), GRID)
    assert d.ragged is not None
    assert [r["x"].shape for r in d.ragged] == [(1, 2), (2, 2)]
    assert d.ragged[1]["x"].dtype == np.float32


def test_ragged_multi_input_rows_are_objects_checked_per_input() -> None:
    rows = [{"ids": [1, 2, 3], "bias": [0.5, 1]}, {"ids": [4], "bias": [2, 3]}]
    d = decode_predict(body({"instances": rows}), MIXED)
    assert d.ragged is not None
    assert [r["ids"].tolist() for r in d.ragged] == [[1, 2, 3], [4]]
    assert d.ragged[0]["bias"].dtype == np.float32
    # Inputs of unknown length in one row may differ: that is the model's business.
    rows = [{"ids": [1, 2, 3], "mask": [1, 1, 1]}, {"ids": [4], "mask": [1, 0]}]
    d = decode_predict(body({"instances": rows}), MULTI)
    assert d.ragged is not None and d.ragged[1]["mask"].shape == (2,)


@pytest.mark.parametrize(
    ("payload", "sig", "message"),
    [
        (
            body({"instances": [[1, 2, 3]] * 3 + [[1, 2, 3, 4, 5, 6, 7]]}),
            SINGLE,
            "instance 3 of input 'x' has shape (7,); the model takes (n, 3) float32: every row "
            "the same shape",
        ),
        (
            body({"instances": [[1, 2], [1, 2.5, 3]]}),
            TOKENS,
            "instance 1 of input 'ids' holds non-integers; expected (n, ?) int32",
        ),
        (
            body({"instances": [[1, 2], [1, 2, True]]}),
            TOKENS,
            "instance 1 of input 'ids' holds booleans",
        ),
        (
            body({"instances": [[1], [1, None]]}),
            TOKENS,
            "instance 1 of input 'ids' is ragged or holds null/non-numbers",
        ),
        (
            body({"instances": [[1], [2, 2**40]]}),
            TOKENS,
            "instance 1 of input 'ids' holds values outside the range of int32",
        ),
        (
            body({"instances": [[1], [[1, 2], [3, 4]]]}),
            TOKENS,
            "instance 1 of input 'ids' has shape (2, 2); the model takes (n, ?) int32",
        ),
        (
            body({"instances": [[[1, 2]], [[1, 2, 3]]]}),
            GRID,
            "instance 1 of input 'x' has shape (1, 3); the model takes (n, ?, 2) float32",
        ),
        (
            body({"instances": [[[1, 2]], [[1, 2], [3]]]}),
            GRID,
            "instance 1 of input 'x' is ragged within itself",
        ),
        (
            body({"instances": [{"ids": [1], "bias": [1, 2]}, {"ids": [1, 2], "bias": [1]}]}),
            MIXED,
            "instance 1 of input 'bias' has shape (1,); the model takes (n, 2) float32",
        ),
        (
            body({"inputs": [[1, 2, 3], [1]]}),
            TOKENS,
            "input 'ids' is ragged (rows of different lengths); expected (n, ?) int32. "
            '"inputs" (columns) takes rectangular arrays only: send rows of different lengths '
            'as "instances"',
        ),
    ],
)
def test_ragged_refusals_name_the_row(payload: bytes, sig: ModelSignature, message: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        decode_predict(payload, sig)
    assert message in info.value.message


def test_encode_rows_answers_each_row_at_its_own_length() -> None:
    tagger = ModelSignature("m", TOKENS.inputs, (TensorSpec("tags", (None, 2), "float32"),))
    padded = np.arange(2 * 4 * 2, dtype=np.float32).reshape(2, 4, 2)
    rows = [{"tags": padded[0, :3]}, {"tags": padded[1, :1]}]
    assert orjson.loads(encode_rows(rows, tagger)) == {
        "predictions": [[[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], [[8.0, 9.0]]]
    }
    # A cut along a later axis is a strided view; a scalar output's row a 0-d array.
    wide = np.arange(2 * 2 * 4, dtype=np.float32).reshape(2, 2, 4)
    outs = [
        {"a": wide[0, :, :3], "b": np.array(1.5, np.float32)},
        {"a": wide[1, :, :1], "b": np.array(2.5, np.float32)},
    ]
    assert orjson.loads(encode_rows(outs, MULTI)) == {
        "predictions": [
            {"a": [[0.0, 1.0, 2.0], [4.0, 5.0, 6.0]], "b": 1.5},
            {"a": [[8.0], [12.0]], "b": 2.5},
        ]
    }
