"""The graceful stop of the real uvicorn server (on loopback) around the fake runner."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from serving.app import create_app
from serving.config import Settings
from serving.graceful import GracefulServer
from serving.state import ServerState
from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner


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
    runner: FakeRunner
    client: httpx.AsyncClient
    serving: asyncio.Task[None]


@pytest.fixture
async def served(raised: list[int]) -> AsyncIterator[Served]:
    runner = FakeRunner()

    async def factory(_: Settings) -> FakeRunner:
        return runner

    settings = Settings(model="fake", batch_timeout_ms=0, max_batch_size=1, max_inflight_batches=1)
    app = create_app(settings, factory)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = GracefulServer(config, lambda: getattr(app.state, "shardserve", None))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await _until(lambda: server.started)
        await app.state.shardserve.ready.wait()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            yield Served(server, app.state.shardserve, runner, client, serving)
    finally:
        server.should_exit = True
        async with asyncio.timeout(10):
            await serving
        sock.close()


async def test_sigterm_refuses_new_requests_and_answers_queued_ones(
    served: Served, raised: list[int]
) -> None:
    server, state, runner, client = served.server, served.state, served.runner, served.client
    gate = runner.gate = asyncio.Event()
    body = {"instances": [[1.0, 2.0, 3.0, 4.0]]}
    in_flight = asyncio.create_task(client.post("/predict", json=body))
    await runner.wait_started(2)  # the warm-up was call 1; this batch holds the only slot
    queued = asyncio.create_task(client.post("/predict", json=body))
    await _until(lambda: state.batcher.queued_rows == 1)

    server.handle_exit(signal.SIGTERM, None)
    ready = await client.get("/readyz")
    refused = await client.post("/predict", json=body)
    assert (ready.status_code, ready.json()["status"]) == (503, "shutting down")
    assert refused.status_code == 503
    assert assert_clean_error(refused) == "server is shutting down"
    assert not server.should_exit  # the listener stays open while rows are queued

    gate.set()
    assert [(await t).status_code for t in (in_flight, queued)] == [200, 200]
    async with asyncio.timeout(10):
        await served.serving
    # uvicorn re-raises the signal once it has stopped, so the exit status says SIGTERM.
    assert raised == [signal.SIGTERM]


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
