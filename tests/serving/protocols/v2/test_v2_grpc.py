"""The Open Inference Protocol over gRPC, in process: the app's lifespan serves grpc.aio on a free
port over the fake runner, and the tests call it through the repo's own stubs."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import numpy as np
import psutil
import pytest
from asgi_lifespan import LifespanManager

from serving.protocols.v2.grpc_server import rpc_deadline
from serving.protocols.v2.proto import grpc_service_pb2 as pb
from serving.protocols.v2.proto import grpc_service_pb2_grpc as pb_grpc
from serving.server.app import create_app
from serving.server.state import ServerState
from serving.settings.config import ConfigError, Settings, load_settings
from shards.signature import ModelSignature, TensorSpec
from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner, expected_outputs, make_rows, row_ids, spawn
from tests.serverproc import free_ports

Tensor = pb.ModelInferRequest.InferInputTensor


@dataclass
class Served:
    stub: pb_grpc.GRPCInferenceServiceStub
    state: ServerState
    http: httpx.AsyncClient
    port: int


@contextlib.asynccontextmanager
async def serve(
    runner: FakeRunner,
    *,
    wait_ready: bool = True,
    loaded: asyncio.Event | None = None,
    **overrides: Any,
) -> AsyncIterator[Served]:
    (port,) = free_ports(1)
    settings = Settings(
        model="fake",
        grpc_port=port,
        **{"batch_timeout_ms": 1000.0, "max_batch_size": 4, **overrides},
    )

    async def factory(_: Settings) -> FakeRunner:
        if loaded is not None:
            await loaded.wait()
        return runner

    app = create_app(settings, factory)
    async with LifespanManager(app) as manager:
        state: ServerState = app.state.shardserve
        if wait_ready:
            await state.model().until_ready()
        transport = httpx.ASGITransport(app=manager.app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://test") as http,
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            yield Served(pb_grpc.GRPCInferenceServiceStub(channel), state, http, port)


def infer_request(rows: np.ndarray, *, name: str = "x", **fields: Any) -> pb.ModelInferRequest:
    """Rows as raw contents (the binary form every Triton client sends)."""
    tensor = Tensor(name=name, datatype="FP32", shape=rows.shape)
    fields = {"model_name": "fake", **fields}
    return pb.ModelInferRequest(inputs=[tensor], raw_input_contents=[rows.tobytes()], **fields)


def answer(response: pb.ModelInferResponse, index: int = 0) -> np.ndarray:
    out = response.outputs[index]
    raw = response.raw_output_contents[index]
    assert out.datatype == "FP32"
    return np.frombuffer(raw, dtype="<f4").reshape(tuple(out.shape))


async def failure(call: Any) -> tuple[grpc.StatusCode, str]:
    """The status code and clean one-line message of a call that must fail."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    details = info.value.details() or ""
    assert_clean_error({"error": details})
    return info.value.code(), details


def rejects(state: ServerState, reason: str) -> float:
    labels = {"model": "fake", "version": "1", "reason": reason}
    value = state.metrics.registry.get_sample_value("shardserve_rejects_total", labels)
    return value or 0.0


def calls_ended(state: ServerState) -> float:
    """Calls of the model whose server handler has ended: each observes its latency once."""
    return sum(
        sample.value
        for family in state.metrics.registry.collect()
        if family.name == "shardserve_request_latency_seconds"
        for sample in family.samples
        if sample.name.endswith("_count") and sample.labels.get("model") == "fake"
    )


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for the server's side of a deadline: it runs on the server's clock, which starts a
    moment after the client's, so the client can see DEADLINE_EXCEEDED first."""
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "the server did not get there in time"
        await asyncio.sleep(0.01)


# ---- the .proto against the protocol as Triton's client ships it -------------------------------


def test_proto_fields_match_tritonclients_stubs() -> None:
    """Every message, field number, type and enum value of our .proto is Triton's own."""
    from tritonclient.grpc import model_config_pb2, service_pb2

    theirs = {
        **service_pb2.DESCRIPTOR.message_types_by_name,
        **model_config_pb2.DESCRIPTOR.message_types_by_name,
    }

    def check(ours: Any, their: Any) -> None:
        assert ours.full_name == their.full_name
        for field in ours.fields:
            other = their.fields_by_name.get(field.name)
            assert other is not None, f"{ours.full_name}.{field.name} is not in Triton's proto"
            assert (field.number, field.type) == (other.number, other.type), field.full_name
            assert field.is_repeated == other.is_repeated, field.full_name
            sub, other_sub = field.message_type, other.message_type
            if sub is not None and not sub.GetOptions().map_entry:
                check(sub, other_sub)
        for nested in ours.nested_types:
            if not nested.GetOptions().map_entry:
                check(nested, their.nested_types_by_name[nested.name])

    assert pb.DESCRIPTOR.package == "inference"
    for name, message in pb.DESCRIPTOR.message_types_by_name.items():
        check(message, theirs[name])
    ours_enum = pb.DESCRIPTOR.enum_types_by_name["DataType"]
    their_enum = model_config_pb2.DESCRIPTOR.enum_types_by_name["DataType"]
    assert [(v.name, v.number) for v in ours_enum.values] == [
        (v.name, v.number) for v in their_enum.values
    ]
    ours_service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    their_service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in ours_service.methods:
        other = their_service.methods_by_name[method.name]
        assert method.input_type.full_name == other.input_type.full_name
        assert method.output_type.full_name == other.output_type.full_name


# ---- health and metadata -------------------------------------------------------------------------


async def test_live_at_once_ready_once_the_model_is_warm() -> None:
    gate = asyncio.Event()  # holds the warm-up batch
    async with serve(FakeRunner(gate=gate), wait_ready=False) as s:
        assert (await s.stub.ServerLive(pb.ServerLiveRequest())).live is True
        assert (await s.stub.ServerReady(pb.ServerReadyRequest())).ready is False
        ready = await s.stub.ModelReady(pb.ModelReadyRequest(name="fake"))
        assert ready.ready is False
        code, message = await failure(s.stub.ModelInfer(infer_request(make_rows(1)["x"])))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert message == "model is still loading; retry when GET /readyz answers 200"
        gate.set()
        await s.state.model().until_ready()
        assert (await s.stub.ServerReady(pb.ServerReadyRequest())).ready is True
        ready = await s.stub.ModelReady(pb.ModelReadyRequest(name="fake", version="1"))
        assert ready.ready is True


async def test_metadata_before_the_model_is_loaded_is_unavailable() -> None:
    loaded = asyncio.Event()
    async with serve(FakeRunner(), wait_ready=False, loaded=loaded) as s:
        code, message = await failure(s.stub.ModelMetadata(pb.ModelMetadataRequest(name="fake")))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert message == "model is still loading; its signature is not known yet"
        loaded.set()


async def test_server_and_model_metadata() -> None:
    async with serve(FakeRunner()) as s:
        server = await s.stub.ServerMetadata(pb.ServerMetadataRequest())
        assert server.name == "shardserve"
        assert server.version == "0.1.0"
        assert "binary_tensor_data" in server.extensions
        meta = await s.stub.ModelMetadata(pb.ModelMetadataRequest(name="fake"))
    assert (meta.name, list(meta.versions), meta.platform) == ("fake", ["1"], "tensorflow_keras")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("x", "FP32", [-1, 4])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("y", "FP32", [-1, 2])]


async def test_model_config_is_tritons_subset() -> None:
    async with serve(FakeRunner(), max_batch_size=8, batch_timeout_ms=2.5) as s:
        config = (await s.stub.ModelConfig(pb.ModelConfigRequest(name="fake"))).config
        http = (await s.http.get("/v2/models/fake/config")).json()
    assert (config.name, config.platform, config.max_batch_size) == ("fake", "tensorflow_keras", 8)
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("x", pb.TYPE_FP32, [4])]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [
        ("y", pb.TYPE_FP32, [2])
    ]
    assert config.HasField("dynamic_batching")
    assert config.dynamic_batching.max_queue_delay_microseconds == 2500
    # The same answer as the HTTP route's, field for field.
    assert http["max_batch_size"] == config.max_batch_size
    assert http["input"][0]["data_type"] == pb.DataType.Name(config.input[0].data_type)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("ModelReady", "model 'other' not found; this server serves 'fake'"),
        ("ModelMetadata", "model 'other' not found; this server serves 'fake'"),
        ("ModelConfig", "model 'other' not found; this server serves 'fake'"),
    ],
)
async def test_unknown_model_is_not_found(call: str, message: str) -> None:
    request = {
        "ModelReady": pb.ModelReadyRequest,
        "ModelMetadata": pb.ModelMetadataRequest,
        "ModelConfig": pb.ModelConfigRequest,
    }[call](name="other")
    async with serve(FakeRunner()) as s:
        code, details = await failure(getattr(s.stub, call)(request))
    assert (code, details) == (grpc.StatusCode.NOT_FOUND, message)


async def test_infer_unknown_model_or_version_is_not_found() -> None:
    rows = make_rows(1)["x"]
    async with serve(FakeRunner()) as s:
        code, message = await failure(s.stub.ModelInfer(infer_request(rows, model_name="other")))
        assert (code, message) == (
            grpc.StatusCode.NOT_FOUND,
            "model 'other' not found; this server serves 'fake'",
        )
        code, message = await failure(s.stub.ModelInfer(infer_request(rows, model_version="2")))
        assert (code, message) == (
            grpc.StatusCode.NOT_FOUND,
            "model 'fake' has no version '2'; its versions: ['1']",
        )


# ---- infer --------------------------------------------------------------------------------------


async def test_infer_raw_contents() -> None:
    rows = make_rows(3, start=5)
    async with serve(FakeRunner(), batch_timeout_ms=0) as s:
        call = s.stub.ModelInfer(infer_request(rows["x"], id="req-7", model_version="1"))
        response = await call
        trailing = dict(await call.trailing_metadata())
    assert (response.model_name, response.model_version, response.id) == ("fake", "1", "req-7")
    assert [o.name for o in response.outputs] == ["y"]
    assert list(response.outputs[0].shape) == [3, 2]
    np.testing.assert_array_equal(answer(response), expected_outputs(rows)["y"])
    assert len(trailing["x-request-id"]) == 24  # a generated id, as HTTP's


async def test_infer_typed_contents() -> None:
    rows = make_rows(2, start=1)
    request = pb.ModelInferRequest(
        model_name="fake",
        inputs=[
            Tensor(
                name="x",
                datatype="FP32",
                shape=[2, 4],
                contents=pb.InferTensorContents(fp32_contents=rows["x"].ravel().tolist()),
            )
        ],
    )
    async with serve(FakeRunner(), batch_timeout_ms=0) as s:
        response = await s.stub.ModelInfer(request)
    np.testing.assert_array_equal(answer(response), expected_outputs(rows)["y"])


async def test_grpc_and_http_requests_share_one_batch() -> None:
    runner = FakeRunner()
    async with serve(runner) as s:
        runner.batches.clear()  # forget the warm-up batch
        grpc_calls = [s.stub.ModelInfer(infer_request(make_rows(1, start=i)["x"])) for i in (0, 1)]
        http_calls = [
            s.http.post("/predict", json={"instances": make_rows(1, start=i)["x"].tolist()})
            for i in (2, 3)
        ]
        results = await asyncio.gather(*grpc_calls, *http_calls)
    assert runner.batch_sizes() == [4]
    assert sorted(row_ids(runner.batches[0])) == [0, 1, 2, 3]
    for i, response in enumerate(results[:2]):
        np.testing.assert_array_equal(
            answer(response), expected_outputs(make_rows(1, start=i))["y"]
        )
    for i, response in zip((2, 3), results[2:], strict=True):
        got = np.asarray(response.json()["predictions"], np.float32)
        np.testing.assert_array_equal(got, expected_outputs(make_rows(1, start=i))["y"])


TWO_HEADS = ModelSignature(
    name="twohead",
    inputs=(TensorSpec("features", (6,), "float32"), TensorSpec("ids", (4,), "int32")),
    outputs=(TensorSpec("score", (1,), "float32"), TensorSpec("klass", (3,), "float32")),
)


async def test_two_inputs_in_any_order_and_outputs_in_the_order_asked() -> None:
    rng = np.random.default_rng(3)
    inputs = {
        "features": rng.normal(size=(3, 6)).astype(np.float32),
        "ids": rng.integers(0, 10, size=(3, 4)).astype(np.int32),
    }
    request = pb.ModelInferRequest(
        model_name="fake",
        inputs=[
            Tensor(name="ids", datatype="INT32", shape=[3, 4]),
            Tensor(name="features", datatype="FP32", shape=[3, 6]),
        ],
        raw_input_contents=[inputs["ids"].tobytes(), inputs["features"].tobytes()],
        outputs=[
            pb.ModelInferRequest.InferRequestedOutputTensor(name="klass"),
            pb.ModelInferRequest.InferRequestedOutputTensor(name="score"),
        ],
    )
    runner = FakeRunner(TWO_HEADS)
    async with serve(runner, batch_timeout_ms=0) as s:
        runner.batches.clear()
        response = await s.stub.ModelInfer(request)
        meta = await s.stub.ModelMetadata(pb.ModelMetadataRequest(name="fake"))
    np.testing.assert_array_equal(runner.batches[0]["ids"][:3], inputs["ids"])
    want = expected_outputs(inputs, TWO_HEADS)
    assert [o.name for o in response.outputs] == ["klass", "score"]
    np.testing.assert_array_equal(answer(response, 0), want["klass"])
    np.testing.assert_array_equal(answer(response, 1), want["score"])
    assert [(t.name, t.datatype) for t in meta.inputs] == [("features", "FP32"), ("ids", "INT32")]


async def test_typed_contents_of_two_inputs_and_a_wrong_field() -> None:
    request = pb.ModelInferRequest(
        model_name="fake",
        inputs=[
            Tensor(
                name="features",
                datatype="FP32",
                shape=[1, 6],
                contents=pb.InferTensorContents(fp32_contents=[0.5] * 6),
            ),
            Tensor(
                name="ids",
                datatype="INT32",
                shape=[1, 4],
                contents=pb.InferTensorContents(int_contents=[1, 2, 3, 4]),
            ),
        ],
    )
    runner = FakeRunner(TWO_HEADS)
    async with serve(runner, batch_timeout_ms=0) as s:
        response = await s.stub.ModelInfer(request)
        want = expected_outputs(
            {"features": np.full((1, 6), 0.5, np.float32), "ids": np.array([[1, 2, 3, 4]])},
            TWO_HEADS,
        )
        np.testing.assert_array_equal(answer(response, 0), want["score"])
        request.inputs[1].contents.int_contents[:] = []
        request.inputs[1].contents.int64_contents[:] = [1, 2, 3, 4]
        code, message = await failure(s.stub.ModelInfer(request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message == (
        "input 'ids' is INT32, whose elements go in contents.int_contents; "
        "got contents.int64_contents"
    )


async def test_infer_returns_the_outputs_asked_for() -> None:
    signature_runner = FakeRunner()
    rows = make_rows(1)["x"]
    ask = [pb.ModelInferRequest.InferRequestedOutputTensor(name="y")]
    async with serve(signature_runner, batch_timeout_ms=0) as s:
        response = await s.stub.ModelInfer(infer_request(rows, outputs=ask))
        assert [o.name for o in response.outputs] == ["y"]
        ask = [pb.ModelInferRequest.InferRequestedOutputTensor(name="z")]
        code, message = await failure(s.stub.ModelInfer(infer_request(rows, outputs=ask)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message == "unknown output 'z'; the model's outputs are ['y']"


def _bad(rows: np.ndarray, **tensor: Any) -> pb.ModelInferRequest:
    fields = {"name": "x", "datatype": "FP32", "shape": rows.shape, **tensor}
    raw = fields.pop("raw", rows.tobytes())
    return pb.ModelInferRequest(
        model_name="fake", inputs=[Tensor(**fields)], raw_input_contents=[raw]
    )


def _timed(request: pb.ModelInferRequest, kind: str, micros: int) -> pb.ModelInferRequest:
    setattr(request.parameters["timeout"], kind, micros)
    return request


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (
            _bad(make_rows(1)["x"].astype("<f8"), datatype="FP64"),
            "input 'x' has datatype FP64; the model expects FP32",
        ),
        (
            _bad(make_rows(1)["x"], raw=make_rows(1)["x"].tobytes()[:12]),
            "input 'x' has 12 bytes of data; shape [1, 4] of FP32 needs 16 bytes (4 x 4)",
        ),
        (
            _bad(make_rows(2)["x"], shape=[2, 3]),
            "input 'x' has shape [2, 3]; the model expects [-1, 4] (the first dimension is rows)",
        ),
        (
            _bad(make_rows(1)["x"], name="features"),
            "unknown input 'features'; the model's inputs are ['x']",
        ),
        (
            pb.ModelInferRequest(
                model_name="fake",
                inputs=[Tensor(name="x", datatype="FP16", shape=[1, 4])],
            ),
            "input 'x' has datatype FP16; the model expects FP32",
        ),
        (
            pb.ModelInferRequest(
                model_name="fake",
                inputs=[
                    Tensor(
                        name="x",
                        datatype="FP32",
                        shape=[1, 4],
                        contents=pb.InferTensorContents(fp64_contents=[1, 2, 3, 4]),
                    )
                ],
            ),
            "input 'x' is FP32, whose elements go in contents.fp32_contents; "
            "got contents.fp64_contents",
        ),
        (
            pb.ModelInferRequest(
                model_name="fake",
                inputs=[Tensor(name="x", datatype="FP32", shape=[1, 4])],
                raw_input_contents=[b"\0" * 16, b"\0" * 16],
            ),
            "raw_input_contents has 2 entries for 1 inputs; give one per input, in the order of "
            "inputs",
        ),
        (
            pb.ModelInferRequest(model_name="fake"),
            "missing input(s) ['x']; the model's inputs are ['x']",
        ),
        (
            _timed(_bad(make_rows(1)["x"]), "int64_param", -5),
            'parameter "timeout" must be a positive number of microseconds, got -5; leave it '
            "out for the server's deadline (request_timeout_ms)",
        ),
        (
            _timed(_bad(make_rows(1)["x"]), "uint64_param", 0),
            'parameter "timeout" must be a positive number of microseconds, got 0; leave it '
            "out for the server's deadline (request_timeout_ms)",
        ),
    ],
    ids=[
        "datatype",
        "byte-count",
        "shape",
        "unknown-input",
        "fp16-no-raw",
        "wrong-typed-field",
        "raw-count",
        "missing",
        "negative-timeout",
        "zero-timeout",
    ],
)
async def test_bad_input_is_invalid_argument(request_: pb.ModelInferRequest, message: str) -> None:
    runner = FakeRunner()
    async with serve(runner, batch_timeout_ms=0) as s:
        runner.batches.clear()
        code, details = await failure(s.stub.ModelInfer(request_))
        assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        assert rejects(s.state, "invalid_input") == 1
    assert runner.batches == []


async def test_model_error_on_the_input_is_invalid_argument() -> None:
    rows = make_rows(1)["x"] - 10  # a negative first value: the fake model's "bad index"
    async with serve(FakeRunner(poison=True), batch_timeout_ms=0) as s:
        code, message = await failure(s.stub.ModelInfer(infer_request(rows)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith("the model failed on this input: InvalidArgumentError: indices[0,0]")


async def test_message_over_max_body_bytes_is_refused() -> None:
    rows = np.zeros((300, 4), np.float32)  # 4800 bytes of raw contents
    async with serve(FakeRunner(), max_body_bytes=4096, max_queue_rows=512) as s:
        code, _ = await failure(s.stub.ModelInfer(infer_request(rows)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---- admission and deadlines ---------------------------------------------------------------------


async def test_full_queue_is_unavailable_before_decoding() -> None:
    gate = asyncio.Event()
    gate.set()  # the warm-up batch passes; then the runner holds every batch
    runner = FakeRunner(gate=gate)
    async with serve(runner, max_queue_rows=4, max_inflight_batches=1, batch_timeout_ms=0) as s:
        gate.clear()
        batcher = s.state.model().require_batcher()
        first = await spawn(batcher.submit(make_rows(4)))  # in flight, held by the gate
        await runner.wait_started(2)
        second = await spawn(batcher.submit(make_rows(4, start=4)))  # fills the queue
        assert batcher.queued_rows == 4
        # A body that would not even decode: refused on the queue alone.
        code, message = await failure(s.stub.ModelInfer(_bad(make_rows(1)["x"], datatype="FP64")))
        assert (code, message) == (
            grpc.StatusCode.UNAVAILABLE,
            "queue full: 4 rows queued, max_queue_rows=4",
        )
        assert rejects(s.state, "queue_full") == 1
        gate.set()
        await asyncio.gather(first, second)
    assert [row_ids(b) for b in runner.batches[1:]] == [[0, 1, 2, 3], [4, 5, 6, 7]]


async def test_client_deadline_drops_the_rows() -> None:
    gate = asyncio.Event()
    gate.set()
    runner = FakeRunner(gate=gate)
    async with serve(runner, max_inflight_batches=1, batch_timeout_ms=0) as s:
        gate.clear()
        batcher = s.state.model().require_batcher()
        held = await spawn(batcher.submit(make_rows(1)))
        await runner.wait_started(2)
        started = time.monotonic()
        call = s.stub.ModelInfer(infer_request(make_rows(1, start=9)["x"]), timeout=0.3)
        code, _ = await failure(call)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.25 < time.monotonic() - started < 5
        # The server's end of the call (its latency observed) comes after everything it counts:
        # the batcher's timer ("deadline"), or gRPC's cancel at the deadline ("cancelled"),
        # whichever came first; the later of the two is no second reject.
        await until(lambda: calls_ended(s.state) == 1)
        assert rejects(s.state, "deadline") + rejects(s.state, "cancelled") == 1
        # The expired request's row left the queue: it is never computed.
        assert batcher.queued_rows == 0
        gate.set()
        await held
    assert [row_ids(b) for b in runner.batches[1:]] == [[0]]


async def test_timeout_parameter_is_the_batchers_deadline() -> None:
    gate = asyncio.Event()
    gate.set()
    runner = FakeRunner(gate=gate)
    async with serve(runner, max_inflight_batches=1, batch_timeout_ms=0) as s:
        gate.clear()
        batcher = s.state.model().require_batcher()
        held = await spawn(batcher.submit(make_rows(1)))
        await runner.wait_started(2)
        request = infer_request(make_rows(1, start=9)["x"])
        request.parameters["timeout"].int64_param = 200_000  # microseconds
        code, message = await failure(s.stub.ModelInfer(request, timeout=30))
        assert (code, message) == (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "the request's deadline passed in the queue",
        )
        assert rejects(s.state, "deadline") == 1
        gate.set()
        await held
    assert [row_ids(b) for b in runner.batches[1:]] == [[0]]


async def test_a_canary_judge_hears_of_routed_calls_and_not_of_a_deadline_the_client_cut() -> None:
    async with serve(FakeRunner(), batch_timeout_ms=0) as s:
        told: list[bool] = []
        s.state.model().metrics.add_routed_listener(lambda failed, _: told.append(failed))
        await s.stub.ModelInfer(infer_request(make_rows(1)["x"]))
        named = infer_request(make_rows(1)["x"])
        named.model_version = "1"  # named: the split did not route it
        await s.stub.ModelInfer(named)
        short = infer_request(make_rows(1)["x"])
        short.parameters["timeout"].int64_param = 1  # microseconds: past before it is queued
        code, _ = await failure(s.stub.ModelInfer(short))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert told == [False]


@pytest.mark.parametrize(
    ("client_s", "server_ms", "timeout_s"),
    [(0.25, 30000.0, 0.25), (120.0, 30000.0, 30.0), (None, 500.0, 0.5), (-1.0, 500.0, 0.0)],
)
def test_rpc_deadline_is_the_sooner_of_client_and_server(
    client_s: float | None, server_ms: float, timeout_s: float
) -> None:
    # Bracketed by the clock read before and after: exact however slow the machine is.
    before = time.monotonic()
    deadline = rpc_deadline(client_s, server_ms)
    after = time.monotonic()

    assert before + timeout_s <= deadline <= after + timeout_s


# ---- the setting ---------------------------------------------------------------------------------


def listening_ports() -> set[int]:
    """The TCP ports this process listens on (an app under LifespanManager binds no HTTP
    port: only a gRPC server would add one)."""
    process = psutil.Process()
    sockets = getattr(process, "net_connections", process.connections)(kind="inet")
    return {s.laddr.port for s in sockets if s.status == psutil.CONN_LISTEN}


async def test_grpc_port_zero_serves_no_grpc() -> None:
    async def factory(_: Settings) -> FakeRunner:
        return FakeRunner()

    # Every port gRPC could take: its default (8001) and any other (a gRPC server given port 0
    # binds a free one). A probe of one port cannot tell (another program may hold it); the
    # sockets this process listens on can, and with a port given they show the new one.
    before = listening_ports()
    app = create_app(Settings(model="fake", grpc_port=0), factory)
    async with LifespanManager(app):
        await app.state.shardserve.model().until_ready()
        during = listening_ports()

    assert during - before == set()


async def test_busy_grpc_port_fails_the_start() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        app = create_app(Settings(model="fake", grpc_port=port), lambda _: asyncio.sleep(3600))
        with pytest.raises(RuntimeError) as info:
            async with LifespanManager(app):
                pass
    assert str(info.value) == (
        f"cannot serve gRPC on 127.0.0.1:{port}: the port is in use or not allowed; "
        "choose another with --grpc-port, or 0 to turn gRPC off"
    )


async def test_stopping_the_app_stops_grpc() -> None:
    async with serve(FakeRunner()) as s:
        port = s.port
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ServerLive(pb.ServerLiveRequest(), timeout=1)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_port_setting() -> None:
    assert load_settings(grpc_port="9001").grpc_port == 9001
    with pytest.raises(ConfigError, match="grpc_port and port are both 8000"):
        load_settings(grpc_port="8000")
    with pytest.raises(ConfigError, match="grpc_port: Input should be less than or equal to 65535"):
        load_settings(grpc_port="70000")
