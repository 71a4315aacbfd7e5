"""A string in a JSON body's tensor data is refused before numpy makes an array of it: N strings
were an array of N times the longest (``<U{longest}``, four bytes a character), so one row of a
1 MB string and 7 empty ones took 32 MB (issue 37, item 1). Every array numpy makes on the way
is watched (``tracemalloc`` would count orjson's parse too, whose allocations it over-reads: 13
times a long string where the peak RSS grows by twice): none is bigger than the body."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest

from serving.errors import InvalidInputError
from serving.protocols.json_strings import holds_string, string_quotes
from serving.protocols.tfserving.codec import decode_predict
from serving.protocols.v2.infer_body import parse_infer
from shards.signature import ModelSignature, TensorSpec

WIDE = ModelSignature("m", (TensorSpec("x", (8,), "float32"),), (TensorSpec("y", (2,), "float32"),))
MULTI = ModelSignature(
    "m",
    (TensorSpec("ids", (2,), "int32"), TensorSpec("mask", (2,), "float32")),
    (TensorSpec("y", (1,), "float32"),),
)
LONG = "s" * (1 << 20)


def _tfserving(payload: Any, signature: ModelSignature = WIDE) -> Callable[[], Any]:
    body = orjson.dumps(payload)
    return lambda: decode_predict(body, signature)


def _v2(data: list[Any], signature: ModelSignature = WIDE) -> Callable[[], Any]:
    entry = {"name": "x", "shape": [1, 8], "datatype": "FP32", "data": data}
    body = orjson.dumps({"id": "a", "inputs": [entry], "outputs": [{"name": "y"}]})
    return lambda: parse_infer(body, None, signature)


@pytest.fixture
def arrays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size in bytes of every array ``np.asarray`` and ``np.array`` make."""
    made: list[int] = []
    asarray, array = np.asarray, np.array

    def watched(make: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        def call(*args: Any, **kwargs: Any) -> np.ndarray:
            result = make(*args, **kwargs)
            made.append(result.nbytes)
            return result

        return call

    monkeypatch.setattr(np, "asarray", watched(asarray))
    monkeypatch.setattr(np, "array", watched(array))
    return made


def _refused(call: Callable[[], Any], arrays: list[int]) -> str:
    with pytest.raises(InvalidInputError) as caught:
        call()
    biggest = max(arrays, default=0)
    assert biggest < len(LONG), f"an array of {biggest / 2**20:.1f} MiB for a 1 MiB string"
    return caught.value.message


@pytest.mark.parametrize(
    "call",
    [
        _tfserving({"instances": [[LONG, "", "", "", "", "", "", ""]]}),
        _tfserving({"inputs": {"x": [["", "", "", "", "", "", "", LONG]]}}),
        _tfserving({"instances": [[1, 2, 3, 4, 5, 6, 7, 8], [LONG, *[""] * 7]]}),
        _v2([LONG, "", "", "", "", "", "", ""]),
        _v2([[1.0, 2.0, 3.0, 4.0], ["", "", "", LONG]]),
    ],
    ids=["instances", "inputs", "second-row", "v2", "v2-nested"],
)
def test_a_long_string_in_the_data_is_refused_before_an_array_is_made(
    call: Callable[[], Any], arrays: list[int]
) -> None:
    assert "holds strings" in _refused(call, arrays)


def test_keyed_rows_with_a_string_in_one_input_are_refused(arrays: list[int]) -> None:
    rows = [{"ids": [1, 2], "mask": [1.0, 0.0]}, {"ids": [3, 4], "mask": [0.5, LONG]}]
    message = _refused(_tfserving({"instances": rows}, MULTI), arrays)
    assert message == "input 'mask' holds strings; expected numbers (n, 2) float32"


def test_quotes_outside_the_data_do_not_refuse_numbers() -> None:
    # an escaped '"' in a name the body may carry: more quotes than its keys take, no string
    body = orjson.dumps({"signature_name": 'a"b', "instances": [[1, 2, 3, 4, 5, 6, 7, 8]]})
    np.testing.assert_array_equal(decode_predict(body, WIDE).inputs["x"], [list(range(1, 9))])
    entry = {"name": "x", "shape": [1, 8], "datatype": "FP32", "data": list(range(8))}
    call = parse_infer(orjson.dumps({"id": 'x"y', "inputs": [entry]}), None, WIDE)
    np.testing.assert_array_equal(call.inputs["x"], [list(range(8))])


def test_string_quotes_count_keys_and_strings_outside_data() -> None:
    payload = {"id": "a", "inputs": [{"name": "x", "data": ["s", "t"]}], "p": {"k": ["v", 1]}}
    # keys id, inputs, name, data, p, k: 12; strings "a", "x", "v": 6; data not walked
    assert string_quotes(payload) == 18


def test_holds_string_walks_nesting_deeper_than_recursion_goes() -> None:
    deep: list[Any] = ["x"]
    for _ in range(5000):
        deep = [deep]
    assert holds_string(deep)
    numbers: list[Any] = [1.0]
    for _ in range(5000):
        numbers = [numbers, 2]
    assert not holds_string(numbers)
