"""A fuzz of both gRPC services' inference messages: whatever a client sends (huge and negative
dimensions, datatypes that are not the model's or not any, values past their dtype's range,
NaN and infinities, long and deep strings, bytes that are no message at all), the answer is a
status that names the client's fault or an answer, never INTERNAL or UNKNOWN (issue 37: a
DT_UINT8 ``int_val`` of 300 was INTERNAL).

One in-process server (the fake runner) runs in a thread of its own, its event loop there; the
examples are called with gRPC's blocking client. The number of examples is bounded and the
seed derandomized: the same few hundred messages each run, a few seconds in all."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.protocols.tfserving.proto import predict_pb2, tensor_pb2, types_pb2
from serving.protocols.v2.proto import grpc_service_pb2 as pb
from shards.signature import ModelSignature, TensorSpec
from tests.fakes import WAIT_S, FakeRunner
from tests.serving.protocols.v2.test_v2_grpc import serve

FUZZ = ModelSignature(
    name="fake",
    inputs=(TensorSpec("ids", (None,), "int32", pad_value=0), TensorSpec("x", (4,), "uint8")),
    outputs=(TensorSpec("y", (2,), "float32"),),
)
V2_METHOD = "/inference.GRPCInferenceService/ModelInfer"
TF_METHOD = "/tensorflow.serving.PredictionService/Predict"
# Never the answer to what a client sent: the server's own fault.
SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FUZZ_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

INT64 = (1 << 63) - 1
DIMS = st.sampled_from([0, 1, 2, 3, 4, 7, 256, 257, 512, 513, 1 << 31, 1 << 40, INT64])
INTS = st.sampled_from(
    [0, 1, -1, 127, 128, 255, 256, 300, -129, 32767, 65536, (1 << 31) - 1, -(1 << 31)]
)
FLOATS = st.sampled_from([0.0, -0.0, 1.5, 1e38, 3.5e38, 1e308, float("nan"), float("inf")])
NAMES = st.sampled_from(["ids", "x", "y", "", "z", "ids" * 1000, "\u00e9\U0001f600"])
TEXT = st.one_of(st.text(max_size=20), st.just("s" * 100_000))
BLOBS = st.one_of(st.binary(max_size=64), st.just(b"\x00" * 4096), st.just(b"\xff" * 100_000))


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """A server over the fake runner, in a thread with its own event loop."""
    ready = threading.Event()
    found: list[int] = []
    stop: list[Any] = []

    async def run() -> None:
        async with serve(FakeRunner(FUZZ), batch_timeout_ms=0, max_queue_rows=256) as s:
            done = asyncio.Event()
            stop.append((asyncio.get_running_loop(), done))
            found.append(s.port)
            ready.set()
            await done.wait()

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    assert ready.wait(WAIT_S * 3), "the fuzz server did not start"
    yield found[0]
    loop, done = stop[0]
    loop.call_soon_threadsafe(done.set)
    thread.join(WAIT_S)


@pytest.fixture(scope="module")
def channel(port: int) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as opened:
        yield opened


def _status(channel: grpc.Channel, method: str, message: bytes) -> grpc.StatusCode:
    call = channel.unary_unary(method)
    try:
        call(message, timeout=WAIT_S)
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        assert code not in SERVER_FAULTS, (code, exc.details())
        return code
    return grpc.StatusCode.OK


# ---- V2's ModelInferRequest ----------------------------------------------------------------------


@st.composite
def v2_tensors(draw: st.DrawFn) -> pb.ModelInferRequest.InferInputTensor:
    tensor = pb.ModelInferRequest.InferInputTensor(
        name=draw(NAMES),
        datatype=draw(
            st.sampled_from(["INT32", "UINT8", "FP32", "BOOL", "BYTES", "BF16", "", "X"])
        ),
        shape=draw(st.lists(st.one_of(DIMS, st.just(-1)), max_size=4)),
    )
    contents = tensor.contents
    kind = draw(st.sampled_from(["int", "int64", "uint", "fp32", "fp64", "bool", "bytes", "none"]))
    size = draw(st.sampled_from([0, 1, 4, 8, 1000]))
    if kind in ("int", "int64"):
        getattr(contents, f"{kind}_contents").extend([draw(INTS)] * size)
    elif kind == "uint":
        contents.uint_contents.extend([abs(draw(INTS))] * size)
    elif kind in ("fp32", "fp64"):
        getattr(contents, f"{kind}_contents").extend([draw(FLOATS)] * size)
    elif kind == "bool":
        contents.bool_contents.extend([True] * size)
    elif kind == "bytes":
        contents.bytes_contents.extend([draw(BLOBS)] * min(size, 8))
    return tensor


@st.composite
def v2_messages(draw: st.DrawFn) -> bytes:
    request = pb.ModelInferRequest(
        model_name=draw(st.sampled_from(["fake", "", "nope", "f" * 100_000])),
        model_version=draw(st.sampled_from(["", "1", "9" * 40, "x"])),
        id=draw(TEXT),
        inputs=draw(st.lists(v2_tensors(), max_size=3)),
    )
    if draw(st.booleans()):
        request.raw_input_contents.extend(draw(st.lists(BLOBS, max_size=3)))
    if draw(st.booleans()):
        request.parameters["timeout"].int64_param = draw(st.sampled_from([0, -1, 1, INT64]))
    for name in draw(st.lists(NAMES, max_size=3)):
        request.outputs.add(name=name)
    return request.SerializeToString()


@FUZZ_SETTINGS
@given(message=st.one_of(v2_messages(), BLOBS))
def test_v2_model_infer_never_answers_internal(channel: grpc.Channel, message: bytes) -> None:
    _status(channel, V2_METHOD, message)


# ---- TF Serving's PredictRequest -----------------------------------------------------------------

_TYPED = {
    "int_val": INTS,
    "int64_val": st.sampled_from([0, -1, INT64, -INT64 - 1, 1 << 40]),
    "uint32_val": st.sampled_from([0, 255, 256, (1 << 32) - 1]),
    "uint64_val": st.sampled_from([0, 1 << 63, (1 << 64) - 1]),
    "half_val": INTS,
    "float_val": FLOATS,
    "double_val": FLOATS,
    "bool_val": st.booleans(),
    "string_val": BLOBS,
}


@st.composite
def tf_tensors(draw: st.DrawFn) -> tensor_pb2.TensorProto:
    dtypes = [*types_pb2.DataType.values(), 1000]
    tensor = tensor_pb2.TensorProto(dtype=draw(st.sampled_from(dtypes)))
    if draw(st.booleans()):
        tensor.tensor_shape.unknown_rank = True
    for size in draw(st.lists(st.one_of(DIMS, st.sampled_from([-1, -INT64])), max_size=4)):
        tensor.tensor_shape.dim.add(size=size)
    kind = draw(st.sampled_from([*_TYPED, "tensor_content", "variant_val", "none"]))
    count = draw(st.sampled_from([0, 1, 2, 4, 8, 1000]))
    if kind == "tensor_content":
        tensor.tensor_content = draw(BLOBS)
    elif kind == "variant_val":
        inner = tensor.variant_val.add(type_name="t")
        inner.tensors.add(dtype=types_pb2.DT_FLOAT, float_val=[1.0])
    elif kind != "none":
        getattr(tensor, kind).extend([draw(_TYPED[kind])] * count)
    return tensor


@st.composite
def tf_messages(draw: st.DrawFn) -> bytes:
    request = predict_pb2.PredictRequest()
    spec = request.model_spec
    spec.name = draw(st.sampled_from(["fake", "", "nope", "f" * 100_000]))
    choice = draw(st.sampled_from(["none", "version", "label"]))
    if choice == "version":
        spec.version.value = draw(st.sampled_from([0, 1, -1, INT64]))
    elif choice == "label":
        spec.version_label = draw(TEXT)
    spec.signature_name = draw(st.sampled_from(["", "serving_default", "other"]))
    for key in draw(st.lists(NAMES, max_size=3, unique=True)):
        request.inputs[key].CopyFrom(draw(tf_tensors()))
    request.output_filter.extend(draw(st.lists(NAMES, max_size=3)))
    return request.SerializeToString()


@FUZZ_SETTINGS
@given(message=st.one_of(tf_messages(), BLOBS))
def test_tfserving_predict_never_answers_internal(channel: grpc.Channel, message: bytes) -> None:
    _status(channel, TF_METHOD, message)


def _tensor(dtype: int, **values: Any) -> tensor_pb2.TensorProto:
    tensor = tensor_pb2.TensorProto(dtype=dtype, **values)  # type: ignore[arg-type]
    for size in (1, 4):
        tensor.tensor_shape.dim.add(size=size)
    return tensor


def test_the_fuzz_reaches_the_model_and_its_refusals(channel: grpc.Channel) -> None:
    """The fuzz's server answers a good request and refuses an overflowing one: the fuzz above
    reaches past the look-up and the bounds, into decoding."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "fake"
    request.inputs["ids"].CopyFrom(_tensor(types_pb2.DT_INT32, int_val=[1, 2, 3, 4]))
    request.inputs["x"].CopyFrom(_tensor(types_pb2.DT_UINT8, int_val=[1, 2, 3, 4]))
    assert _status(channel, TF_METHOD, request.SerializeToString()) == grpc.StatusCode.OK
    request.inputs["x"].CopyFrom(_tensor(types_pb2.DT_UINT8, int_val=[300, 2, 3, 4]))
    code = _status(channel, TF_METHOD, request.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
