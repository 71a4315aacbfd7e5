"""gRPC's ``ModelInfer`` admits as HTTP's predict path does (both are the data plane,
``serving.protocols.dataplane``): the same retry hint on a refusal (HTTP's ``Retry-After``,
gRPC's ``retry-after`` trailing metadata), the admission held until the call is answered (a
drain waits for it), and a cap on the calls served at once (``grpc_max_concurrent_rpcs``)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from serving.protocols.v2.proto import grpc_service_pb2 as pb
from serving.version.stop_budget import StopBudget
from tests.fakes import FakeRunner, make_rows, spawn
from tests.serving.protocols.v2.test_v2_grpc import infer_request, rejects, serve


async def refused(call: grpc.aio.UnaryUnaryCall) -> tuple[grpc.StatusCode, dict[str, str]]:
    """The status code and trailing metadata of a call that must fail."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    metadata = info.value.trailing_metadata() or ()
    return info.value.code(), {key: value for key, value in metadata if isinstance(value, str)}


async def test_a_full_queue_is_unavailable_with_the_retry_hint_http_gives() -> None:
    gate = asyncio.Event()
    gate.set()  # the warm-up batch passes; then the runner holds every batch
    runner = FakeRunner(gate=gate)
    async with serve(runner, max_queue_rows=4, max_inflight_batches=1, batch_timeout_ms=0) as s:
        gate.clear()
        batcher = s.state.model().require_batcher()
        first = await spawn(batcher.submit(make_rows(4)))  # in flight, held by the gate
        await runner.wait_started(2)
        second = await spawn(batcher.submit(make_rows(4, start=4)))  # fills the queue
        code, metadata = await refused(
            s.stub.ModelInfer(infer_request(make_rows(1)["x"]), metadata=(("x-request-id", "g1"),))
        )
        http = await s.http.post(
            "/v2/models/fake/infer",
            json={"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}]},
        )
        gate.set()
        await asyncio.gather(first, second)
    assert code == grpc.StatusCode.UNAVAILABLE
    timing = metadata.pop("server-timing")  # issue 30: every answer carries its Server-Timing
    assert timing.startswith("queue;dur=")
    assert metadata == {"x-request-id": "g1", "retry-after": "1"}
    assert http.status_code == 503
    assert metadata["retry-after"] == http.headers["retry-after"]
    assert rejects(s.state, "queue_full") == 2  # one each


async def test_an_admitted_call_holds_its_admission_until_it_is_answered() -> None:
    """The model's drain (a stop, a version switch) waits for the requests it admitted
    (``Admitted``) before it stops the batcher: a gRPC call is one of them, as an HTTP one is."""
    gate = asyncio.Event()
    gate.set()
    runner = FakeRunner(gate=gate)
    async with serve(runner, max_inflight_batches=1, batch_timeout_ms=0) as s:
        gate.clear()
        model = s.state.model()
        call = asyncio.ensure_future(s.stub.ModelInfer(infer_request(make_rows(1)["x"])))
        await runner.wait_started(2)  # the call's rows are in the batch the gate holds
        held = model.admitted.count
        idle_before = await model.admitted.wait_idle(0)
        drain = asyncio.ensure_future(model.drain(StopBudget.start(60)))
        gate.set()
        response = await call
        async with asyncio.timeout(10):
            await drain
        idle_after = await model.admitted.wait_idle(0)
    assert (held, idle_before) == (1, False)
    assert response.model_name == "fake"
    assert (model.admitted.count, idle_after) == (0, True)


async def test_calls_past_grpc_max_concurrent_rpcs_are_refused() -> None:
    gate = asyncio.Event()
    gate.set()
    runner = FakeRunner(gate=gate)
    async with serve(runner, grpc_max_concurrent_rpcs=1, batch_timeout_ms=0) as s:
        gate.clear()
        held = asyncio.ensure_future(s.stub.ModelInfer(infer_request(make_rows(1)["x"])))
        await runner.wait_started(2)  # the one call served at once
        code, _ = await refused(s.stub.ServerLive(pb.ServerLiveRequest(), timeout=10))
        gate.set()
        await held
        # The cap counts calls in progress: once the held one ended, a call is served again.
        async with asyncio.timeout(10):
            while True:
                try:
                    live = await s.stub.ServerLive(pb.ServerLiveRequest(), timeout=10)
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    await asyncio.sleep(0.01)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert live.live
