"""A ``PredictRequest`` with more inputs, values or fields than its model's queue can take is
refused before protobuf parses it (``serving.protocols.tfserving.grpc_bounds``), as V2's
``ModelInferRequest`` is; its refusal quotes what the client sent cut short (issue 37, item 4:
a 4.3 MB message of unknown input keys was parsed, +168 MiB, and its refusal echoed a 3.5 MB
list of them). The messages are built with our own compiled protos: no TensorFlow import."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.errors import InvalidInputError
from serving.protocols.tfserving import grpc_service
from serving.protocols.tfserving.grpc_bounds import scan_predict_request
from serving.protocols.tfserving.proto import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_pb2,
    predict_pb2,
    tensor_pb2,
    tensor_shape_pb2,
    types_pb2,
)
from serving.protocols.v2.proto import grpc_service_pb2 as pb
from serving.protocols.wire import InferBounds
from tests.fakes import FakeRunner
from tests.serving.protocols.v2.test_v2_grpc import rejects, serve

METHOD = "/tensorflow.serving.PredictionService/Predict"
MiB = 1 << 20
BOUNDS = InferBounds(model="fake", inputs=1, outputs=1, rank=2, values=1024)


class Parses:
    """``grpc_service``'s protobuf module as the server sees it, counting the parses of a
    ``PredictRequest``."""

    def __init__(self) -> None:
        self.count = 0
        parses = self

        class _Request:
            @staticmethod
            def FromString(data: bytes) -> predict_pb2.PredictRequest:
                parses.count += 1
                return predict_pb2.PredictRequest.FromString(data)

        self.PredictRequest = _Request

    def __getattr__(self, name: str) -> Any:
        return getattr(predict_pb2, name)


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Parses:
    counted = Parses()
    monkeypatch.setattr(grpc_service, "predict_pb2", counted)
    return counted


def _tensor(rows: np.ndarray) -> tensor_pb2.TensorProto:
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_content=rows.tobytes())
    for size in rows.shape:
        tensor.tensor_shape.dim.add(size=size)
    return tensor


def _request(**inputs: tensor_pb2.TensorProto) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "fake"
    for key, tensor in inputs.items():
        request.inputs[key].CopyFrom(tensor)
    return request


async def _call(port: int, message: bytes) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(METHOD)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(message)
    return info.value.code(), info.value.details() or ""


async def test_a_message_of_many_unknown_inputs_is_refused_unparsed_and_quoted_short(
    parses: Parses,
) -> None:
    request = _request()
    one = _tensor(np.zeros((1, 4), np.float32))
    for i in range(80_000):
        request.inputs[f"unknown-input-{i:08d}"].CopyFrom(one)
    message = request.SerializeToString()
    assert len(message) > 4 * MiB
    async with serve(FakeRunner()) as s:
        code, details = await _call(s.port, message)
        assert rejects(s.state, "invalid_input") == 1
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(details) < 300, len(details)
    assert (
        details == "the message has 2+ inputs; model 'fake' takes 1: send each of its inputs once"
    )
    assert parses.count == 0


async def test_a_request_within_the_bound_is_parsed_and_served(parses: Parses) -> None:
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    async with (
        serve(FakeRunner(), batch_timeout_ms=0) as s,
        grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as channel,
    ):
        answer = await channel.unary_unary(METHOD)(_request(x=_tensor(rows)).SerializeToString())
    response = predict_pb2.PredictResponse.FromString(answer)
    assert [d.size for d in response.outputs["y"].tensor_shape.dim] == [2, 2]
    assert parses.count == 1


async def test_an_unknown_model_named_at_length_is_not_found_quoted_short(parses: Parses) -> None:
    request = _request(x=_tensor(np.zeros((1, 4), np.float32)))
    request.model_spec.name = "m" * (2 * MiB)
    async with serve(FakeRunner()) as s:
        code, details = await _call(s.port, request.SerializeToString())
    assert code == grpc.StatusCode.NOT_FOUND
    assert details.startswith("model 'mmmm") and len(details) < 300, details[:400]
    assert parses.count == 0


def _scan(request: predict_pb2.PredictRequest | bytes) -> None:
    data = request if isinstance(request, bytes) else request.SerializeToString()
    scan_predict_request(data, lambda selector: BOUNDS)


def _typed(**fields: Any) -> tensor_pb2.TensorProto:
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, **fields)
    tensor.tensor_shape.dim.add(size=1)
    tensor.tensor_shape.dim.add(size=4)
    return tensor


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (
            _request(x=_typed(float_val=[1.0] * 1025)),
            "+ typed values; a request to model 'fake' holds at most 1024",
        ),
        (_request(x=_typed(int64_val=[300] * 2000)), "typed values; a request to model 'fake'"),
        (_request(x=_typed(string_val=[b"s"] * 1025)), "+ typed values"),
        (
            _request(x=_typed(tensor_content=b"\0" * (8 * 1024 + 1))),
            "8193 bytes of tensor_content; a request to model 'fake' holds at most 1024 values",
        ),
        (
            _request(x=_typed(variant_val=[tensor_pb2.VariantTensorDataProto()])),
            "an input has variant_val, which no served model takes",
        ),
        (
            _request(x=tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT)),
            None,  # within every bound: the decoder says what is wrong with it
        ),
    ],
    ids=["floats", "int64", "strings", "content", "variant", "within"],
)
def test_typed_values_and_content_are_held_to_the_model(
    request_: predict_pb2.PredictRequest, words: str | None
) -> None:
    if words is None:
        _scan(request_)
        return
    with pytest.raises(InvalidInputError) as caught:
        _scan(request_)
    assert words in caught.value.message


def test_a_shape_of_many_dimensions_and_repeated_shapes_are_refused() -> None:
    deep = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT)
    for _ in range(1000):
        deep.tensor_shape.dim.add(size=1)
    with pytest.raises(InvalidInputError, match="a shape of 3\\+ dimensions"):
        _scan(_request(x=deep))
    one = tensor_shape_pb2.TensorShapeProto()
    one.dim.add(size=1)
    shape = b"\x12" + bytes([len(one.SerializeToString())]) + one.SerializeToString()
    tensor = shape * 3  # three tensor_shape fields: protobuf merges their dims into one shape
    entry = b"\x0a\x01x\x12" + bytes([len(tensor)]) + tensor
    spec = b"\x0a\x06\x0a\x04fake"
    with pytest.raises(InvalidInputError, match="a shape of 3\\+ dimensions"):
        _scan(spec + b"\x12" + bytes([len(entry)]) + entry)


def test_empty_packed_runs_count_so_that_the_walk_is_bounded() -> None:
    tensor = b"\x2a\x00" * 1025  # float_val, packed, empty: nothing to protobuf, a step to us
    entry = b"\x0a\x01x\x12" + _varint(len(tensor)) + tensor
    message = b"\x0a\x06\x0a\x04fake\x12" + _varint(len(entry)) + entry
    assert len(predict_pb2.PredictRequest.FromString(message).inputs["x"].float_val) == 0
    with pytest.raises(InvalidInputError, match="1025\\+ typed values"):
        _scan(message)


def test_the_model_spec_comes_first_and_output_filter_is_held_to_the_outputs() -> None:
    request = predict_pb2.PredictRequest(output_filter=["y"] * 300)
    request.model_spec.name = "fake"
    data = request.SerializeToString()
    late = data[data.index(b"\x1a") :] + data[: data.index(b"\x1a")]  # model_spec last
    with pytest.raises(InvalidInputError, match="over 256 fields before its model_spec"):
        _scan(late)
    with pytest.raises(InvalidInputError, match="output_filter names 2\\+ outputs"):
        _scan(request)


def test_the_model_spec_is_read_as_protobuf_reads_it() -> None:
    seen: list[Any] = []
    request = _request()
    request.model_spec.version.value = -3
    scan_predict_request(request.SerializeToString(), lambda s: seen.append(s) or BOUNDS)
    request.model_spec.version_label = "canary"  # a oneof: the label replaces the version
    scan_predict_request(request.SerializeToString(), lambda s: seen.append(s) or BOUNDS)
    assert seen == [("fake", "-3", None), ("fake", None, "canary")]


def test_bytes_that_are_no_message_are_invalid() -> None:
    with pytest.raises(InvalidInputError, match="not a valid PredictRequest"):
        _scan(b"\x0a\xff\xff\xff\xff\x0f")


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tensor_message(tensor: bytes) -> bytes:
    entry = b"\x0a\x01x\x12" + _varint(len(tensor)) + tensor
    return b"\x0a\x06\x0a\x04fake\x12" + _varint(len(entry)) + entry


@pytest.mark.parametrize(
    ("field", "each", "values"),
    [
        (b"\x2d\x00\x00\x80\x3f", 1, 1),  # float_val 1.0, one field each
        (b"\x38\x05", 1, 1),  # int_val 5, one field each
        (b"\x3a\x03\x01\x02\x03", 3, 3),  # int_val packed, three a run
        (b"\x2a\x08" + b"\x00" * 8, 2, 2),  # float_val packed, two a run
        (b"\x2a\x00", 0, 1),  # an empty run: nothing to protobuf, a value to the walk
    ],
)
def test_fields_repeated_alike_count_as_one_at_a_time(field: bytes, each: int, values: int) -> None:
    """Runs of fields shaped alike are skipped a stride at a time, counted as each alone."""
    for times in (100, 2000):
        message = _tensor_message(field * times)
        parsed = predict_pb2.PredictRequest.FromString(message).inputs["x"]
        assert len(parsed.float_val) + len(parsed.int_val) == each * times
        bounds = InferBounds(model="fake", inputs=1, outputs=1, rank=2, values=values * 1000)
        if times * values <= bounds.values:
            scan_predict_request(message, lambda selector, b=bounds: b)
        else:
            with pytest.raises(InvalidInputError, match=r"[0-9]+\+ typed values"):
                scan_predict_request(message, lambda selector, b=bounds: b)


def test_runs_of_varints_of_different_lengths_are_walked_exactly() -> None:
    fields = b"".join(b"\x38" + _varint(v) for v in [1, 300, 70_000, 5] * 300)  # int_val
    message = _tensor_message(fields)
    bounds = InferBounds(model="fake", inputs=1, outputs=1, rank=2, values=1200)
    scan_predict_request(message, lambda selector: bounds)
    tight = InferBounds(model="fake", inputs=1, outputs=1, rank=2, values=1199)
    with pytest.raises(InvalidInputError, match="1200\\+ typed values"):
        scan_predict_request(message, lambda selector: tight)


_FIELD = st.one_of(
    st.integers(0, 1 << 35).map(lambda v: b"\x38" + _varint(v)),  # int_val, one field each
    st.binary(min_size=4, max_size=4).map(lambda b: b"\x2d" + b),  # float_val, one field each
    st.lists(st.integers(0, 1 << 20), max_size=5).map(
        lambda vs: b"\x3a" + _varint(len(p := b"".join(map(_varint, vs)))) + p  # int_val packed
    ),
    st.integers(0, 3).map(lambda n: b"\x2a" + _varint(4 * n) + b"\x00" * 4 * n),  # float_val
    st.binary(max_size=3).map(lambda b: b"\x42" + _varint(len(b)) + b),  # string_val
)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(fields=st.lists(st.lists(_FIELD, min_size=1, max_size=3), max_size=12))
def test_the_walk_never_counts_fewer_values_than_protobuf_reads(fields: list[list[bytes]]) -> None:
    """Whatever mix of fields (runs of one repeated, lengths that differ), the count that the
    bound refuses by is at least what protobuf parses: the bound holds the parse."""
    tensor = b"".join(group * 3 for group in (b"".join(f) for f in fields))  # runs alike
    message = _tensor_message(tensor)
    parsed = predict_pb2.PredictRequest.FromString(message).inputs["x"]
    values = len(parsed.int_val) + len(parsed.float_val) + len(parsed.string_val)
    most = values + tensor.count(b"\x38") + tensor.count(b"\x2d") + tensor.count(b"\x3a") + 512
    scan_predict_request(message, lambda selector: replace(BOUNDS, values=most))
    if values:
        with pytest.raises(InvalidInputError, match="typed values"):
            scan_predict_request(message, lambda selector: replace(BOUNDS, values=values - 1))


@pytest.mark.parametrize(
    ("method", "message"),
    [
        (
            "/tensorflow.serving.PredictionService/GetModelMetadata",
            get_model_metadata_pb2.GetModelMetadataRequest(
                metadata_field=["signature_def"] * 10_000
            ),
        ),
        (
            "/tensorflow.serving.ModelService/GetModelStatus",
            get_model_status_pb2.GetModelStatusRequest(
                model_spec=model_pb2.ModelSpec(name="m" * 100_000)
            ),
        ),
        (
            "/inference.GRPCInferenceService/ModelMetadata",
            pb.ModelMetadataRequest(name="fake", version="9" * 100_000),
        ),
    ],
    ids=["tf-metadata", "tf-status", "v2-metadata"],
)
async def test_a_look_of_more_than_64_kib_is_refused_before_it_is_parsed(
    method: str, message: Any
) -> None:
    data = message.SerializeToString()
    assert len(data) > 64 * 1024
    async with (
        serve(FakeRunner()) as s,
        grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as channel,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary(method)(data)
        small = message.__class__()
        if hasattr(small, "model_spec"):
            small.model_spec.name = "fake"
        else:
            small.name = "fake"
        if hasattr(small, "metadata_field"):
            small.metadata_field.append("signature_def")
        assert await channel.unary_unary(method)(small.SerializeToString())  # served
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"message is {len(data):,} bytes; it is at most 65,536" in (info.value.details() or "")
