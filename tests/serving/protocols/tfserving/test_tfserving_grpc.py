"""TensorFlow Serving's gRPC API, in process: the app's lifespan serves grpc.aio on a free port
over the fake runner, and the tests call it as a TF Serving user does, with the official
``tensorflow-serving-api`` stubs and ``tf.make_tensor_proto`` inputs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from asgi_lifespan import LifespanManager
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tensorflow.core.framework import tensor_pb2 as tf_tensor_pb2
from tensorflow.core.framework import types_pb2 as tf_types_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_management_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from serving.batching.lengths import LengthPadding, length_buckets
from serving.protocols.tfserving.proto import get_model_metadata_pb2 as our_metadata_pb2
from serving.protocols.tfserving.proto import get_model_status_pb2 as our_status_pb2
from serving.protocols.tfserving.proto import inference_pb2 as our_inference_pb2
from serving.protocols.tfserving.proto import model_service_pb2 as our_model_service_pb2
from serving.protocols.tfserving.proto import predict_pb2 as our_predict_pb2
from serving.protocols.tfserving.proto import tensor_pb2 as our_tensor_pb2
from serving.server.app import create_app
from serving.server.state import ServerState
from serving.settings.config import Settings
from serving.version.life import VersionState
from shards.signature import ModelSignature, TensorSpec
from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner, expected_outputs, make_rows, row_ids, spawn
from tests.serverproc import free_ports
from tests.serving.protocols.v2.test_v2_grpc import serve as serve_v2
from tests.serving.protocols.v2.test_v2_grpc import until

State = get_model_status_pb2.ModelVersionStatus.State


@dataclass
class Served:
    predict: prediction_service_pb2_grpc.PredictionServiceStub
    models: model_service_pb2_grpc.ModelServiceStub
    channel: grpc.aio.Channel
    state: ServerState
    http: Any
    v2: Any


@contextlib.asynccontextmanager
async def serve(runner: FakeRunner, **overrides: Any) -> AsyncIterator[Served]:
    async with (
        serve_v2(runner, **overrides) as s,
        grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as channel,
    ):
        yield Served(
            prediction_service_pb2_grpc.PredictionServiceStub(channel),
            model_service_pb2_grpc.ModelServiceStub(channel),
            channel,
            s.state,
            s.http,
            s.stub,
        )


def predict_request(
    inputs: dict[str, Any], *, name: str = "fake", **spec: Any
) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = name
    for key, value in spec.items():
        if key == "version":
            request.model_spec.version.value = value
        else:
            setattr(request.model_spec, key, value)
    for key, value in inputs.items():
        tensor = (
            value if isinstance(value, tf_tensor_pb2.TensorProto) else tf.make_tensor_proto(value)
        )
        request.inputs[key].CopyFrom(tensor)
    return request


def output(response: predict_pb2.PredictResponse, name: str = "y") -> np.ndarray:
    return tf.make_ndarray(response.outputs[name])


async def failure(call: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """The status code, clean one-line message and trailing metadata of a failing call."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    details = info.value.details() or ""
    assert_clean_error({"error": details})
    trailing = dict(info.value.trailing_metadata() or ())
    return info.value.code(), details, trailing


# ---- the .proto against TF Serving's and TensorFlow's own ----------------------------------------


def test_proto_fields_match_the_official_stubs() -> None:
    """Every message, field number, type and enum value of ours is TF Serving's (or
    TensorFlow's) own; ours may leave fields out, never differ."""

    seen: set[str] = set()

    def check(ours: Any, theirs: Any) -> None:
        assert ours.full_name == theirs.full_name
        if ours.full_name in seen:  # TensorProto holds VariantTensorDataProto holds TensorProto
            return
        seen.add(ours.full_name)
        for field in ours.fields:
            other = theirs.fields_by_name[field.name]
            assert (field.number, field.type) == (other.number, other.type), field.full_name
            assert field.is_repeated == other.is_repeated, field.full_name
            if field.message_type is not None:
                check(field.message_type, other.message_type)
            if field.enum_type is not None:
                values = {v.name: v.number for v in other.enum_type.values}
                for value in field.enum_type.values:
                    assert values[value.name] == value.number, value.full_name

    for ours, theirs in [
        (our_predict_pb2.PredictRequest, predict_pb2.PredictRequest),
        (our_predict_pb2.PredictResponse, predict_pb2.PredictResponse),
        (our_metadata_pb2.GetModelMetadataRequest, get_model_metadata_pb2.GetModelMetadataRequest),
        (
            our_metadata_pb2.GetModelMetadataResponse,
            get_model_metadata_pb2.GetModelMetadataResponse,
        ),
        (our_metadata_pb2.SignatureDefMap, get_model_metadata_pb2.SignatureDefMap),
        (our_status_pb2.GetModelStatusRequest, get_model_status_pb2.GetModelStatusRequest),
        (our_status_pb2.GetModelStatusResponse, get_model_status_pb2.GetModelStatusResponse),
        (our_inference_pb2.ClassificationRequest, classification_pb2.ClassificationRequest),
        (our_model_service_pb2.ReloadConfigRequest, model_management_pb2.ReloadConfigRequest),
        (our_model_service_pb2.ReloadConfigResponse, model_management_pb2.ReloadConfigResponse),
        (our_tensor_pb2.TensorProto, tf_tensor_pb2.TensorProto),
    ]:
        check(ours.DESCRIPTOR, theirs.DESCRIPTOR)
    dtypes = {v.name: v.number for v in tf_types_pb2.DataType.DESCRIPTOR.values}
    ours_dtypes = our_tensor_pb2.TensorProto.DESCRIPTOR.fields_by_name["dtype"].enum_type
    assert {v.name: v.number for v in ours_dtypes.values} == {
        k: v for k, v in dtypes.items() if not k.endswith("_REF")
    }


def test_our_messages_and_tensorflows_live_in_one_process() -> None:
    """TensorFlow's own tensor_pb2 (imported above, in the default pool) and ours, in one pool
    of their own: no "duplicate symbol", and the bytes of one parse as the other."""
    theirs = tf.make_tensor_proto(np.arange(6, dtype=np.float32).reshape(2, 3))
    ours = our_tensor_pb2.TensorProto.FromString(theirs.SerializeToString())
    assert ours.DESCRIPTOR.file.pool is not tf_tensor_pb2.TensorProto.DESCRIPTOR.file.pool
    assert [d.size for d in ours.tensor_shape.dim] == [2, 3]
    assert tf_tensor_pb2.TensorProto.FromString(ours.SerializeToString()) == theirs


# ---- Predict -------------------------------------------------------------------------------------


async def test_predict_answers_as_rest_does() -> None:
    rows = make_rows(3)["x"]
    async with serve(FakeRunner()) as s:
        response = await s.predict.Predict(predict_request({"x": rows}))
        rest = await s.http.post("/predict", json={"instances": rows.tolist()})
    got = output(response)
    np.testing.assert_array_equal(got, np.asarray(rest.json()["predictions"], np.float32))
    assert response.outputs["y"].dtype == tf_types_pb2.DT_FLOAT
    assert response.outputs["y"].tensor_content  # the fast form, not float_val
    assert response.model_spec.name == "fake"
    assert response.model_spec.version.value == 1
    assert response.model_spec.signature_name == "serving_default"


async def test_predict_rows_batch_with_v2_and_rest_rows() -> None:
    runner = FakeRunner()
    async with serve(runner) as s:
        runner.batches.clear()  # forget the warm-up batch
        tfs = [
            s.predict.Predict(predict_request({"x": make_rows(1, start=i)["x"]})) for i in (0, 1)
        ]
        rest = [
            s.http.post("/predict", json={"instances": make_rows(1, start=i)["x"].tolist()})
            for i in (2, 3)
        ]
        results = await asyncio.gather(*tfs, *rest)
    assert runner.batch_sizes() == [4]
    assert sorted(row_ids(runner.batches[0])) == [0, 1, 2, 3]
    for i, response in enumerate(results[:2]):
        np.testing.assert_array_equal(
            output(response), expected_outputs(make_rows(1, start=i))["y"]
        )


@pytest.mark.parametrize(
    "tensor",
    [
        tf.make_tensor_proto(np.arange(8, dtype=np.float64).reshape(2, 4)),  # DT_DOUBLE
        tf.make_tensor_proto(np.arange(8, dtype=np.float16).reshape(2, 4)),  # DT_HALF
        tf.make_tensor_proto(np.arange(8, dtype=np.int32).reshape(2, 4)),  # DT_INT32
        tf.make_tensor_proto(np.arange(8, dtype=np.int64).reshape(2, 4)),  # DT_INT64
        tf.make_tensor_proto(np.arange(8, dtype=ml_dtypes.bfloat16).reshape(2, 4), tf.bfloat16),
        # The typed fields, as a client that fills them itself sends them.
        tf_tensor_pb2.TensorProto(
            dtype=tf_types_pb2.DT_FLOAT,
            tensor_shape=tf.TensorShape([2, 4]).as_proto(),
            float_val=list(range(8)),
        ),
        tf_tensor_pb2.TensorProto(
            dtype=tf_types_pb2.DT_HALF,
            tensor_shape=tf.TensorShape([2, 4]).as_proto(),
            half_val=np.arange(8, dtype=np.float16).view(np.uint16).tolist(),
        ),
        tf_tensor_pb2.TensorProto(
            dtype=tf_types_pb2.DT_BFLOAT16,
            tensor_shape=tf.TensorShape([2, 4]).as_proto(),
            half_val=np.arange(8, dtype=ml_dtypes.bfloat16).view(np.uint16).tolist(),
        ),
    ],
    ids=["double", "half", "int32", "int64", "bfloat16", "float_val", "half_val", "bf16_half_val"],
)
async def test_predict_takes_every_numeric_form(tensor: tf_tensor_pb2.TensorProto) -> None:
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert tf.make_ndarray(tensor).astype(np.float32).tolist() == rows.tolist()
    async with serve(FakeRunner()) as s:
        response = await s.predict.Predict(predict_request({"x": tensor}))
    np.testing.assert_array_equal(output(response), expected_outputs({"x": rows})["y"])


async def test_one_typed_value_fills_the_shape_as_tensorflow_reads_it() -> None:
    tensor = tf.make_tensor_proto(2.5, dtype=tf.float32, shape=[3, 4])
    assert list(tensor.float_val) == [2.5]
    async with serve(FakeRunner()) as s:
        response = await s.predict.Predict(predict_request({"x": tensor}))
    rows = np.full((3, 4), 2.5, np.float32)
    np.testing.assert_array_equal(output(response), expected_outputs({"x": rows})["y"])


TWO_HEADS = ModelSignature(
    name="twohead",
    inputs=(TensorSpec("features", (6,), "float32"), TensorSpec("ids", (4,), "int32")),
    outputs=(TensorSpec("score", (1,), "float32"), TensorSpec("klass", (3,), "float32")),
)


async def test_a_multi_input_model_and_output_filter() -> None:
    features = np.arange(12, dtype=np.float32).reshape(2, 6)
    ids = np.arange(8, dtype=np.int32).reshape(2, 4)
    async with serve(FakeRunner(TWO_HEADS)) as s:
        response = await s.predict.Predict(predict_request({"ids": ids, "features": features}))
        filtered = predict_request({"ids": ids, "features": features})
        filtered.output_filter.append("klass")
        only = await s.predict.Predict(filtered)
        rest = await s.http.post(
            "/predict", json={"inputs": {"features": features.tolist(), "ids": ids.tolist()}}
        )
    want = rest.json()["outputs"]
    assert sorted(response.outputs) == ["klass", "score"]
    for name in ("score", "klass"):
        np.testing.assert_array_equal(output(response, name), np.asarray(want[name], np.float32))
    assert list(only.outputs) == ["klass"]


TOKENS = ModelSignature(
    name="fake",
    inputs=(TensorSpec("ids", (None,), "int32"),),
    outputs=(TensorSpec("y", (2,), "float32"),),
)
LIMIT = 64


async def test_requests_of_different_lengths_share_a_batch_through_length_padding() -> None:
    runner = FakeRunner(TOKENS)
    async with serve(
        runner, max_sequence_length=LIMIT, max_batch_size=3, batch_timeout_ms=10_000.0
    ) as s:
        batcher = s.state.model().batcher
        assert batcher is not None
        batcher.set_length_padding(
            LengthPadding(axes={"ids": 1}, pad_values={"ids": 0}, buckets=length_buckets(LIMIT))
        )
        before = len(runner.batches)
        short = np.array([[1, 2, 3]], np.int32)
        long = np.arange(LIMIT, dtype=np.int32).reshape(1, LIMIT) + 100
        middle = np.arange(10, dtype=np.int32).reshape(1, 10) + 7
        a, b, rest = await asyncio.gather(
            s.predict.Predict(predict_request({"ids": short})),
            s.predict.Predict(predict_request({"ids": long})),
            s.http.post("/predict", json={"instances": middle.tolist()}),
        )
    assert [batch["ids"].shape for batch in runner.batches[before:]] == [(3, LIMIT)]
    np.testing.assert_array_equal(output(a), expected_outputs({"ids": short}, TOKENS)["y"])
    np.testing.assert_array_equal(output(b), expected_outputs({"ids": long}, TOKENS)["y"])
    want = expected_outputs({"ids": middle}, TOKENS)["y"]
    np.testing.assert_array_equal(np.asarray(rest.json()["predictions"], np.float32), want)


# ---- errors --------------------------------------------------------------------------------------

_ROWS = np.zeros((1, 4), np.float32)


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (
            predict_request({"x": np.array([[b"a", b"b", b"c", b"d"]])}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "input 'x' is DT_STRING; the model takes (n, 4) float32: send it as DT_FLOAT",
        ),
        (
            predict_request({"x": np.zeros((1, 5), np.float32)}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "input 'x' has shape [1, 5]; expected (n, 4) float32",
        ),
        (
            predict_request({"x": np.zeros((1, 4), np.bool_)}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "input 'x' is DT_BOOL (booleans); the model takes numbers (n, 4) float32",
        ),
        (
            predict_request({"z": _ROWS}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown input(s) ['z']; the model's inputs are ['x']",
        ),
        (
            predict_request({}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "missing input(s) ['x']; the model's inputs are ['x']",
        ),
        (
            predict_request({"x": _ROWS}, signature_name="classify"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "signature 'classify' is not served; the model's one signature is 'serving_default' "
            "(or leave signature_name empty)",
        ),
        (
            predict_request({"x": _ROWS}, name="nope"),
            grpc.StatusCode.NOT_FOUND,
            None,
        ),
        (predict_request({"x": _ROWS}, version=7), grpc.StatusCode.NOT_FOUND, None),
        (predict_request({"x": _ROWS}, version_label="stable"), grpc.StatusCode.NOT_FOUND, None),
    ],
    ids=["string", "shape", "bool", "unknown", "missing", "signature", "model", "version", "label"],
)
async def test_bad_predict_has_its_code(
    request_: predict_pb2.PredictRequest, code: grpc.StatusCode, message: str | None
) -> None:
    async with serve(FakeRunner()) as s:
        got, details, trailing = await failure(s.predict.Predict(request_))
    assert got == code
    if message is not None:
        assert details == message
    assert trailing["x-request-id"]


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (tf_types_pb2.DT_UINT8, 300),
        (tf_types_pb2.DT_UINT8, -1),
        (tf_types_pb2.DT_INT8, 200),
        (tf_types_pb2.DT_INT16, 40_000),
        (tf_types_pb2.DT_UINT16, 70_000),
    ],
)
async def test_a_typed_value_outside_its_dtype_is_invalid_not_internal(
    dtype: int, value: int
) -> None:
    # int_val carries these dtypes in int32s: numpy's OverflowError was an INTERNAL
    tensor = tf_tensor_pb2.TensorProto(dtype=dtype, int_val=[value, 1, 2, 3])  # type: ignore[arg-type]
    tensor.tensor_shape.dim.add(size=1)
    tensor.tensor_shape.dim.add(size=4)
    async with serve(FakeRunner()) as s:
        code, message, _ = await failure(s.predict.Predict(predict_request({"x": tensor})))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith("input 'x' holds values outside the range of DT_"), message


async def test_output_filter_naming_no_output_is_invalid() -> None:
    request = predict_request({"x": _ROWS})
    request.output_filter.append("logits")
    async with serve(FakeRunner()) as s:
        code, message, _ = await failure(s.predict.Predict(request))
    assert (code, message) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "output_filter names 'logits'; the model's outputs are ['y']",
    )


async def test_message_over_max_body_bytes_is_resource_exhausted() -> None:
    rows = np.zeros((300, 4), np.float32)  # 4800 bytes of tensor_content
    async with serve(FakeRunner(), max_body_bytes=4096, max_queue_rows=512) as s:
        code, _, _ = await failure(s.predict.Predict(predict_request({"x": rows})))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_full_queue_is_unavailable_with_its_retry_hint() -> None:
    gate = asyncio.Event()
    gate.set()  # the warm-up batch passes; then the runner holds every batch
    runner = FakeRunner(gate=gate)
    async with serve(runner, max_queue_rows=4, max_inflight_batches=1, batch_timeout_ms=0) as s:
        gate.clear()
        batcher = s.state.model().require_batcher()
        first = await spawn(batcher.submit(make_rows(4)))
        await runner.wait_started(2)
        second = await spawn(batcher.submit(make_rows(4, start=4)))
        code, message, trailing = await failure(s.predict.Predict(predict_request({"x": _ROWS})))
        assert (code, message) == (
            grpc.StatusCode.UNAVAILABLE,
            "queue full: 4 rows queued, max_queue_rows=4",
        )
        assert int(trailing["retry-after"]) >= 1
        gate.set()
        await asyncio.gather(first, second)


async def test_client_deadline_is_deadline_exceeded() -> None:
    gate = asyncio.Event()
    gate.set()
    runner = FakeRunner(gate=gate)
    async with serve(runner, max_inflight_batches=1, batch_timeout_ms=0) as s:
        gate.clear()
        held = await spawn(s.state.model().require_batcher().submit(make_rows(1)))
        await runner.wait_started(2)
        call = s.predict.Predict(predict_request({"x": _ROWS}), timeout=0.3)
        code, _, _ = await failure(call)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.set()
        await held


async def test_not_ready_is_unavailable() -> None:
    loaded = asyncio.Event()
    async with serve(FakeRunner(), wait_ready=False, loaded=loaded) as s:
        code, _, _ = await failure(s.predict.Predict(predict_request({"x": _ROWS})))
        assert code == grpc.StatusCode.UNAVAILABLE
        status = await s.models.GetModelStatus(status_request())
        assert [v.state for v in status.model_version_status] == [State.LOADING]
        loaded.set()


async def test_classify_regress_multi_inference_and_reload_are_unimplemented() -> None:
    async with serve(FakeRunner()) as s:
        request = classification_pb2.ClassificationRequest()
        request.model_spec.name = "fake"
        code, message, _ = await failure(s.predict.Classify(request))
        assert (code, message) == (
            grpc.StatusCode.UNIMPLEMENTED,
            "Classify is not served by this server; call Predict",
        )
        reload = model_management_pb2.ReloadConfigRequest()
        code, message, _ = await failure(s.models.HandleReloadConfigRequest(reload))
        assert code == grpc.StatusCode.UNIMPLEMENTED
        assert "repository" in message


# ---- metadata and status -------------------------------------------------------------------------


async def test_metadata_is_a_signature_def_map_the_official_client_unpacks() -> None:
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = "fake"
    async with serve(FakeRunner(TOKENS), max_sequence_length=LIMIT) as s:
        response = await s.predict.GetModelMetadata(request)
        bad = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["graph"])
        bad.model_spec.name = "fake"
        code, _, _ = await failure(s.predict.GetModelMetadata(bad))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    packed = response.metadata["signature_def"]
    assert packed.type_url == "type.googleapis.com/tensorflow.serving.SignatureDefMap"
    signatures = get_model_metadata_pb2.SignatureDefMap()
    assert packed.Unpack(signatures)
    signature = signatures.signature_def["serving_default"]
    ids = signature.inputs["ids"]
    assert ids.dtype == tf_types_pb2.DT_INT32
    assert [d.size for d in ids.tensor_shape.dim] == [-1, -1]
    assert [d.size for d in signature.outputs["y"].tensor_shape.dim] == [-1, 2]
    assert signature.method_name == "tensorflow/serving/predict"
    assert response.model_spec.version.value == 1


def status_request(**spec: Any) -> get_model_status_pb2.GetModelStatusRequest:
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "fake"
    for key, value in spec.items():
        if key == "version":
            request.model_spec.version.value = value
        else:
            setattr(request.model_spec, key, value)
    return request


async def test_model_status_available_and_unknown_version() -> None:
    async with serve(FakeRunner()) as s:
        status = await s.models.GetModelStatus(status_request())
        named = await s.models.GetModelStatus(status_request(version=1))
        code, _, _ = await failure(s.models.GetModelStatus(status_request(version=2)))
    [entry] = status.model_version_status
    assert (entry.version, entry.state, entry.status.error_code) == (1, State.AVAILABLE, 0)
    assert named == status
    assert code == grpc.StatusCode.NOT_FOUND


async def test_a_failed_load_reads_end_with_its_error_over_grpc_and_rest() -> None:
    (port,) = free_ports(1)

    async def factory(_: Settings) -> FakeRunner:
        raise RuntimeError("cannot read the SavedModel: broken")

    app = create_app(Settings(model="fake", grpc_port=port), factory)
    async with (
        LifespanManager(app) as manager,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        state: ServerState = app.state.shardserve
        await until(lambda: state.model(split=False).state is VersionState.FAILED)
        status = await model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
            status_request()
        )
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            rest = (await http.get("/v1/models/fake")).json()["model_version_status"][0]
    [entry] = status.model_version_status
    assert entry.state == State.END
    assert entry.status.error_code == 14  # tensorflow.error.Code.UNAVAILABLE
    assert "broken" in entry.status.error_message
    assert (rest["state"], rest["status"]["error_message"]) == ("END", entry.status.error_message)


# ---- what operators expect on the port -----------------------------------------------------------


async def test_health_per_service_and_per_model() -> None:
    loaded = asyncio.Event()
    async with serve(FakeRunner(), wait_ready=False, loaded=loaded) as s:
        health = health_pb2_grpc.HealthStub(s.channel)

        async def check(service: str) -> int:
            return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        assert await check("fake") == not_serving
        loaded.set()
        await s.state.model().until_ready()
        for service in (
            "",
            "tensorflow.serving.PredictionService",
            "inference.GRPCInferenceService",
            "fake",
            "fake/1",
        ):
            assert await check(service) == serving, service
        code, _, _ = await failure(health.Check(health_pb2.HealthCheckRequest(service="nope")))
        assert code == grpc.StatusCode.NOT_FOUND
        watch = health.Watch(health_pb2.HealthCheckRequest(service="fake"))
        first = await watch.read()
        assert first.status == serving
        watch.cancel()


async def test_reflection_lists_every_service_and_describes_predict() -> None:
    async with serve(FakeRunner()) as s:
        stub = reflection_pb2_grpc.ServerReflectionStub(s.channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="tensorflow.serving.PredictionService"
            ),
        ]
        answers = [answer async for answer in stub.ServerReflectionInfo(iter(requests))]
    services = {svc.name for svc in answers[0].list_services_response.service}
    assert services == {
        "inference.GRPCInferenceService",
        "tensorflow.serving.PredictionService",
        "tensorflow.serving.ModelService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    files = answers[1].file_descriptor_response.file_descriptor_proto
    assert len(files) > 5  # the service's file and every file it imports
