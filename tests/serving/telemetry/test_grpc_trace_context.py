"""A gRPC client's W3C trace context (``traceparent`` in the call's metadata) becomes the parent
of the call's request span, on V2's ``ModelInfer`` and TF Serving's ``Predict``; a call without
one starts a trace of its own. In process: the fake runner, an in-memory span exporter; the
e2e test (``tests/e2e/test_tracing_server.py``) receives a real server's OTLP export."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serving.protocols.tfserving.proto import predict_pb2, prediction_service_pb2_grpc
from serving.protocols.tfserving.proto import types_pb2 as tf_types
from serving.telemetry import active
from serving.telemetry.traces import Tracer
from tests.fakes import FakeRunner, make_rows
from tests.serving.protocols.v2.test_v2_grpc import infer_request, serve

V2_TRACE, TFS_TRACE = "0af7651916cd43dd8448eb211c80319c", "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = 0x00F067AA0BA902B7


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(active, "tracer", Tracer(provider))
    yield exporter


def _traceparent(trace_id: str) -> tuple[tuple[str, str], ...]:
    return (("traceparent", f"00-{trace_id}-{PARENT_SPAN:016x}-01"), ("tracestate", "k=v"))


def _predict_request(rows: int) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "fake"
    tensor = request.inputs["x"]
    tensor.dtype = tf_types.DT_FLOAT
    tensor.tensor_shape.dim.add().size = rows
    tensor.tensor_shape.dim.add().size = 4
    tensor.float_val.extend(float(i) for i in range(rows * 4))
    return request


async def test_a_grpc_clients_traceparent_is_the_parent_of_the_request_span(
    exported: InMemorySpanExporter,
) -> None:
    async with serve(FakeRunner(), batch_timeout_ms=0) as s:
        exported.clear()
        await s.stub.ModelInfer(infer_request(make_rows(2)["x"]), metadata=_traceparent(V2_TRACE))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as channel:
            tfs = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            await tfs.Predict(_predict_request(1), metadata=_traceparent(TFS_TRACE))
            await tfs.Predict(_predict_request(1))  # no trace context: a trace of its own
    requests = [s for s in exported.get_finished_spans() if s.name == "infer fake"]
    assert len(requests) == 3
    by_trace = {f"{span.context.trace_id:032x}": span for span in requests}
    for trace_id in (V2_TRACE, TFS_TRACE):
        span = by_trace[trace_id]
        assert span.parent is not None and span.parent.span_id == PARENT_SPAN
        assert span.parent.is_remote
        assert span.context.trace_state.get("k") == "v"
        assert span.attributes["http.response.status_code"] == 200
    (own,) = [s for t, s in by_trace.items() if t not in (V2_TRACE, TFS_TRACE)]
    assert own.parent is None
    assert {by_trace[V2_TRACE].attributes["shardserve.rows"], own.attributes["shardserve.rows"]} == {
        2, 1,
    }  # fmt: skip
