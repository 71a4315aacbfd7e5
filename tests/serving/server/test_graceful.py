"""The graceful stop of the real uvicorn server (on loopback) around the fake runner: a drain
that answers what it can, and one stop budget that every phase fits in."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
import uvicorn

from serving.protocols.v2.proto import grpc_service_pb2_grpc as pb_grpc
from serving.server.app import create_app
from serving.server.graceful import GracefulServer
from serving.server.state import ServerState
from serving.settings.config import Settings
from serving.version.stop_budget import StopBudget
from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner, make_rows
from tests.serverproc import free_ports
from tests.serving.protocols.v2.test_v2_grpc import infer_request

BODY = {"instances": [[1.0, 2.0, 3.0, 4.0]]}


async def _until(condition: object, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.005)


@pytest.fixture
def raised(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Signals the server re-raised on itself (recorded, not delivered: they would end pytest)."""
    seen: list[int] = []
    monkeypatch.setattr(signal, "raise_signal", seen.append)
    return seen


@dataclass
class Served:
    server: GracefulServer
    state: ServerState
    client: httpx.AsyncClient
    serving: asyncio.Task[None]


@contextlib.asynccontextmanager
async def serve(runner: FakeRunner, **overrides: Any) -> AsyncIterator[Served]:
    async def factory(_: Settings) -> FakeRunner:
        return runner

    settings = Settings(
        model="fake",
        **{"batch_timeout_ms": 0, "max_batch_size": 1, "max_inflight_batches": 1, **overrides},
    )
    app = create_app(settings, factory)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = GracefulServer(config, lambda: getattr(app.state, "shardserve", None))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await _until(lambda: server.started)
        await app.state.shardserve.model().until_ready()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            yield Served(server, app.state.shardserve, client, serving)
    finally:
        server.should_exit = True
        async with asyncio.timeout(30):
            await serving
        sock.close()


async def test_sigterm_refuses_new_requests_and_answers_queued_ones(raised: list[int]) -> None:
    runner = FakeRunner()
    async with serve(runner) as served:
        server, state, client = served.server, served.state, served.client
        gate = runner.gate = asyncio.Event()
        in_flight = asyncio.create_task(client.post("/predict", json=BODY))
        await runner.wait_started(2)  # the warm-up was call 1; this batch holds the only slot
        queued = asyncio.create_task(client.post("/predict", json=BODY))
        await _until(lambda: state.model().batcher.queued_rows == 1)

        server.handle_exit(signal.SIGTERM, None)
        ready = await client.get("/readyz")
        refused = await client.post("/predict", json=BODY)
        v2_ready = await client.get("/v2/health/ready")
        # The listener stays open while rows are held: new requests get an answer, not a reset.
        assert (ready.status_code, ready.json()["status"]) == (503, "shutting down")
        assert refused.status_code == 503
        assert assert_clean_error(refused) == "server is shutting down"
        assert v2_ready.status_code == 503
        assert not served.serving.done()

        gate.set()
        assert [(await t).status_code for t in (in_flight, queued)] == [200, 200]
        async with asyncio.timeout(10):
            await served.serving
    # uvicorn re-raises the signal once it has stopped, so the exit status says SIGTERM.
    assert raised == [signal.SIGTERM]


class StuckRunner(FakeRunner):
    """A stage that hangs (its gate never opens) and a close that never returns."""

    async def close(self) -> None:
        self.closed = True
        await asyncio.Event().wait()


async def test_a_hung_stage_gets_every_held_request_answered_within_the_stop_budget(
    raised: list[int],
) -> None:
    budget_s = 2.0
    runner = StuckRunner()
    (grpc_port,) = free_ports(1)
    async with serve(runner, stop_timeout_s=budget_s, grpc_port=grpc_port) as served:
        runner.gate = asyncio.Event()  # never set: every batch from now on hangs
        in_flight = asyncio.create_task(served.client.post("/predict", json=BODY))
        await runner.wait_started(2)
        queued = asyncio.create_task(served.client.post("/predict", json=BODY))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            rpc = stub.ModelInfer(infer_request(make_rows(1)["x"]))
            await _until(lambda: served.state.model().batcher.queued_rows == 2)

            signalled = time.monotonic()
            served.server.handle_exit(signal.SIGTERM, None)
            answers = await asyncio.gather(in_flight, queued)
            answered = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await rpc
        async with asyncio.timeout(10):  # without the budget: 30 s of drain, then more
            await served.serving
        stopped = time.monotonic()

    assert [a.status_code for a in answers] == [503, 503]
    assert assert_clean_error(answers[0]) == "server is shutting down: the batch was cancelled"
    assert assert_clean_error(answers[1]) == "server is shutting down"
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "server is shutting down"
    # The held requests are failed at the drain mark, not before, and the whole stop (a runner
    # whose close never returns included) ends at the budget; the slack is for a loaded machine.
    drain_s = StopBudget(budget_s, deadline=budget_s).drain_until
    assert drain_s - 0.05 < answered - signalled < budget_s
    assert stopped - signalled < budget_s + 1.0
    assert runner.closed
    assert raised == [signal.SIGTERM]


def test_the_budget_keeps_time_for_the_answers_and_the_close() -> None:
    budget = StopBudget(25.0, deadline=100.0)
    assert (budget.drain_until, budget.answer_until) == (93.0, 95.0)  # 2 s to answer, 5 to close
    small = StopBudget(5.0, deadline=100.0)
    assert (small.drain_until, small.answer_until) == (98.5, 99.0)


def test_a_second_signal_stops_at_once(raised: list[int]) -> None:
    server = GracefulServer(uvicorn.Config(create_app(Settings(model="fake"))), lambda: None)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        server.handle_exit(signal.SIGTERM, None)  # nothing loaded: nothing to drain
        assert server.should_exit and raised == []
        server.handle_exit(signal.SIGTERM, None)
        assert raised == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
