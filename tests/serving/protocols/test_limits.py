"""A request is held to what the model's queue can take before it costs per-row work or memory
(issue 27, items 4 and 5): a JSON body's values counted before it is parsed, its rows right
after, a declared V2 shape's dimensions before anything is shaped by it, in every protocol.
The costs are asserted as allocations (tracemalloc's peak), never as time."""

from __future__ import annotations

import contextlib
import tracemalloc
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import orjson
import pytest

from serving.errors import InvalidInputError
from serving.protocols.limits import RequestLimits
from serving.protocols.tfserving.codec import decode_predict
from serving.protocols.v2.infer_body import parse_infer
from serving.protocols.v2.proto import grpc_service_pb2 as pb
from shards.signature import ModelSignature, TensorSpec
from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner
from tests.serving.protocols.v2.test_v2_grpc import serve as serve_grpc
from tests.serving.served_app import serve

MiB = 2**20
TOKENS = ModelSignature(
    name="fake",
    inputs=(TensorSpec("tokens", (None,), "int32", pad_value=0),),
    outputs=(TensorSpec("y", (4,), "float32"),),
)
PAIR = ModelSignature(
    name="fake",
    inputs=(
        TensorSpec("ids", (None,), "int32", pad_value=0),
        TensorSpec("grid", (3, None), "float32"),
    ),
    outputs=(TensorSpec("a", (1,), "float32"), TensorSpec("b", (2,), "float32")),
)
# demo-tokens' limits in the issue's report: 256 rows of at most 512 tokens.
LIMITS = RequestLimits(max_rows=256, max_length=512)


@contextlib.contextmanager
def peak_bytes() -> Iterator[list[int]]:
    """The peak of what Python allocated inside the block (appended when it ends)."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def ragged_body(rows: int) -> bytes:
    """The issue's body: one row of 512 tokens, then ``rows`` rows of one."""
    return orjson.dumps({"instances": [[1] * 512] + [[1]] * rows})


# --- the bounds themselves: a request at the limit always passes, however it is laid out


def test_a_request_at_the_limit_passes_in_every_layout() -> None:
    limits = RequestLimits(max_rows=8, max_length=16)
    ids, grid = [7] * 16, [[0.5] * 16] * 3
    keyed = {"instances": [{"ids": ids, "grid": grid}] * 8, "signature_name": "serving_default"}
    columns = {"inputs": {"ids": [ids] * 8, "grid": [grid] * 8}}
    for payload in (keyed, columns):
        decoded = decode_predict(orjson.dumps(payload, option=orjson.OPT_INDENT_2), PAIR, limits)
        assert decoded.rows == 8 and decoded.inputs["grid"].shape == (8, 3, 16)
    # V2 with nested data, every parameter a client may add, and both outputs asked for.
    v2 = {
        "id": "r1",
        "parameters": {"timeout": 10**6, "priority": 1, "binary_data_output": False},
        "inputs": [
            {"name": "ids", "shape": [8, 16], "datatype": "INT32", "data": [ids] * 8},
            {"name": "grid", "shape": [8, 3, 16], "datatype": "FP32", "data": [grid] * 8},
        ],
        "outputs": [{"name": "a", "parameters": {"binary_data": False}}, {"name": "b"}],
    }
    call = parse_infer(orjson.dumps(v2), None, PAIR, limits)
    assert call.inputs["grid"].shape == (8, 3, 16)


# --- item 4: a ragged instances body of many rows


def test_the_issues_ragged_body_is_refused_before_it_is_parsed() -> None:
    body = ragged_body(200_000)
    with peak_bytes() as peak, pytest.raises(InvalidInputError) as refused:
        decode_predict(body, TOKENS, LIMITS)
    assert refused.value.message == (
        "the body holds 200003+ JSON arrays and objects ('[' and '{'); a request of at most 256 "
        "rows (max_queue_rows) of 'tokens' (n, ?) int32 holds at most 608: send at most 256 rows "
        "per request"
    )
    assert peak[0] < 64 * 1024  # orjson alone built ~24 MB of lists for it


def test_too_many_values_in_one_row_are_refused_before_they_are_parsed() -> None:
    body = b'{"instances": [[' + b"1," * MiB + b"1]]}"  # one row of 1 Mi tokens, 2 MiB
    with peak_bytes() as peak, pytest.raises(InvalidInputError) as refused:
        decode_predict(body, TOKENS, LIMITS)
    assert "JSON values (commas)" in refused.value.message
    assert "each at most 512 long (max_sequence_length)" in refused.value.message
    assert peak[0] < 64 * 1024


async def test_too_many_rows_are_refused_before_a_row_is_decoded_or_padded() -> None:
    """Rows within the JSON bound (each a list of one) but over max_queue_rows: refused right
    after parsing, before a dict and an array per row and a padded copy of each."""
    runner = FakeRunner(TOKENS)
    rows = 4000  # 2 x max_queue_rows (2000) fit the body's bound of arrays
    body = ragged_body(rows - 1)
    async with serve(runner, max_queue_rows=2000, max_sequence_length=512) as client:
        warm_up = len(runner.batches)
        with peak_bytes() as peak:
            r = await client.post(
                "/v1/models/fake:predict",
                content=body,
                headers={"content-type": "application/json"},
            )
    assert r.status_code == 400
    assert assert_clean_error(r) == (
        f"request has {rows} rows; at most 2000 (max_queue_rows) fit: send at most 2000 rows "
        "per request"
    )
    assert len(runner.batches) == warm_up
    # Padding them to 512 alone was 4000 x 2 KiB (8 MB), twice over (rows, then concatenated).
    assert peak[0] < 3 * MiB, peak


async def test_the_issues_body_through_the_route_costs_no_per_row_memory() -> None:
    runner = FakeRunner(TOKENS)
    body = ragged_body(200_000)
    async with serve(runner, max_queue_rows=256, max_sequence_length=512) as client:
        warm_up = len(runner.batches)
        with peak_bytes() as peak:
            r = await client.post(
                "/v1/models/fake:predict",
                content=body,
                headers={"content-type": "application/json"},
            )
        assert r.status_code == 400
        assert "holds at most 608: send at most 256 rows per request" in assert_clean_error(r)
        assert (await client.get("/healthz")).status_code == 200
    assert len(runner.batches) == warm_up
    assert peak[0] < 3 * len(body), peak  # the body and the transport's copy of it; was ~1 GB


# --- V2: many inputs, too many values, huge shapes


def v2_body(*inputs: dict[str, Any]) -> bytes:
    return orjson.dumps({"inputs": list(inputs)})


def test_a_v2_body_of_many_inputs_or_values_is_refused_before_it_is_parsed() -> None:
    many = {"name": "tokens", "shape": [1, 1], "datatype": "INT32", "data": [1]}
    values = {"name": "tokens", "shape": [1, 1], "datatype": "INT32", "data": [1] * (1 << 20)}
    for body, words in (
        (v2_body(*[many] * 100_000), "JSON arrays and objects"),
        (
            v2_body(values),
            "JSON values (commas)",
        ),
    ):
        with peak_bytes() as peak, pytest.raises(InvalidInputError) as refused:
            parse_infer(body, None, TOKENS, LIMITS)
        assert words in refused.value.message
        assert peak[0] < 64 * 1024


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (
            [2**62, 0],
            f"input 'tokens' has shape ({2**62}, 0): {2**62} rows, over max_queue_rows=256, the "
            "most a request may hold; send at most 256 rows",
        ),
        (
            [1, 2**62],
            f"input 'tokens' has shape (1, {2**62}): length {2**62} in dimension 1 is over "
            "max_sequence_length=512, the longest this server takes; send at most 512",
        ),
    ],
)
def test_a_huge_declared_shape_is_refused_naming_it_and_the_limit(
    shape: list[int], message: str
) -> None:
    tensor = {"name": "tokens", "shape": shape, "datatype": "INT32"}
    with pytest.raises(InvalidInputError) as as_json:
        parse_infer(v2_body({**tensor, "data": []}), None, TOKENS, LIMITS)
    assert as_json.value.message == message
    header = v2_body({**tensor, "parameters": {"binary_data_size": 0}})
    with pytest.raises(InvalidInputError) as as_binary:
        parse_infer(header, str(len(header)), TOKENS, LIMITS)
    assert as_binary.value.message == message


async def test_the_issues_v2_shape_is_a_400_not_a_500() -> None:
    body = {"inputs": [{"name": "tokens", "shape": [2**62, 0], "datatype": "INT32", "data": []}]}
    async with serve(FakeRunner(TOKENS), max_queue_rows=256) as client:
        r = await client.post("/v2/models/fake/infer", content=orjson.dumps(body))
    assert r.status_code == 400
    assert assert_clean_error(r).startswith(
        f"input 'tokens' has shape ({2**62}, 0): {2**62} rows, over max_queue_rows=256"
    )


async def test_a_shape_longer_than_the_models_own_bound_names_that_bound() -> None:
    """Without --max-sequence-length a model whose position embedding has 32 rows is served
    up to 32 (``TensorSpec.max_length``): a declared shape is held to that, not to 512."""
    bounded = ModelSignature(
        name="fake",
        inputs=(TensorSpec("tokens", (None,), "int32", pad_value=0, max_length=32),),
        outputs=(TensorSpec("y", (4,), "float32"),),
    )
    body = {"inputs": [{"name": "tokens", "shape": [1, 2**40], "datatype": "INT32", "data": []}]}
    async with serve(FakeRunner(bounded)) as client:
        r = await client.post("/v2/models/fake/infer", content=orjson.dumps(body))
    assert r.status_code == 400
    assert f"length {2**40} in dimension 1 is over max_sequence_length=32" in assert_clean_error(r)


async def test_a_huge_grpc_shape_is_invalid_argument_raw_or_typed() -> None:
    tensor = pb.ModelInferRequest.InferInputTensor
    huge = tensor(name="tokens", datatype="INT32", shape=[2**62, 0])
    raw = pb.ModelInferRequest(model_name="fake", inputs=[huge], raw_input_contents=[b""])
    typed = pb.ModelInferRequest(model_name="fake", inputs=[huge])
    long = tensor(name="tokens", datatype="INT32", shape=[1, 2**40])
    # The contents of a declared 2**40 elements are not read into a list: refused by the shape.
    too_long = pb.ModelInferRequest(model_name="fake", inputs=[long])
    too_long.inputs[0].contents.int_contents.extend([1] * 1000)
    async with serve_grpc(FakeRunner(TOKENS), max_queue_rows=256) as served:
        for request, words in (
            (raw, f"{2**62} rows, over max_queue_rows=256"),
            (typed, f"{2**62} rows, over max_queue_rows=256"),
            (too_long, f"length {2**40} in dimension 1 is over max_sequence_length="),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await served.stub.ModelInfer(request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in (refused.value.details() or "")


def test_typed_grpc_contents_of_the_wrong_count_are_refused_by_their_length() -> None:
    from serving.protocols.v2.grpc_codec import decode_inputs

    request = pb.ModelInferRequest(
        inputs=[
            pb.ModelInferRequest.InferInputTensor(name="tokens", datatype="INT32", shape=[2, 3])
        ]
    )
    request.inputs[0].contents.int_contents.extend(range(5))
    with pytest.raises(InvalidInputError) as refused:
        decode_inputs(request, TOKENS, LIMITS)
    assert refused.value.message == "input 'tokens' has 5 values; shape [2, 3] holds 6"
    request.inputs[0].contents.int_contents.append(6)
    np.testing.assert_array_equal(
        decode_inputs(request, TOKENS, LIMITS)["tokens"], [[0, 1, 2], [3, 4, 6]]
    )
