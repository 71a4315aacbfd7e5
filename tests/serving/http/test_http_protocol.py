"""Queue-full refusals answered in uvicorn's protocol (serving.http.protocol), on a real uvicorn
server in this event loop: the answer is the app's own 503, the app never sees the request,
the connection stays usable, and everything the app must answer itself still reaches it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import uvicorn
from starlette.types import Receive, Scope, Send

from serving.config import Settings
from serving.http.protocol import http_protocol
from serving.server.app import create_app
from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner
from tests.serverproc import free_ports
from tests.serving.test_fastpath import Recorder


def awaiting(task: asyncio.Task[Any]) -> list[str]:
    """The coroutines ``task`` is suspended in, outermost first."""
    names = []
    coro: Any = task.get_coro()
    while hasattr(coro, "cr_code"):
        names.append(coro.cr_code.co_qualname)
        coro = coro.cr_await
    return names


def row(i: int) -> list[float]:
    return [float(i), 1.0, 2.0, 3.0]


class Counting:
    """The ASGI app as uvicorn calls it, counting the HTTP requests that reach it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.http = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.http += 1
        await self.app(scope, receive, send)


@contextlib.asynccontextmanager
async def running(
    runner: FakeRunner, seen: list[str] | None = None
) -> AsyncIterator[tuple[httpx.AsyncClient, Counting, Any]]:
    """A server on a free port; ``seen``: with a user's middleware (``Recorder``) noting
    each request in it."""
    settings = Settings(
        model="fake", batch_timeout_ms=0, max_batch_size=2, max_queue_rows=2,
        max_inflight_batches=1, max_body_bytes=4096,
    )  # fmt: skip

    async def factory(_: Settings) -> FakeRunner:
        return runner

    app = create_app(settings, factory)
    if seen is not None:
        app.add_middleware(Recorder, seen=seen)
    counting = Counting(app)
    (port,) = free_ports(1)
    config = uvicorn.Config(
        counting, host="127.0.0.1", port=port, log_level="warning", http=http_protocol(app)
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(30):
            while not server.started:
                await asyncio.sleep(0.01)
            await app.state.shardserve.ready.wait()
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=10
        ) as client:
            yield client, counting, app.state.shardserve
    finally:
        server.should_exit = True
        await task


async def test_a_full_queue_is_refused_before_the_app() -> None:
    gate = asyncio.Event()
    runner = FakeRunner()
    async with (
        running(runner) as (client, counting, state),
        httpx.AsyncClient(base_url=str(client.base_url), timeout=10) as others,
    ):
        # The first request builds the middleware stack: the app then knows nothing wraps it.
        assert (await client.post("/predict", json={"instances": [row(9)]})).status_code == 200
        runner.gate = gate
        first = asyncio.create_task(others.post("/predict", json={"instances": [row(0), row(1)]}))
        await runner.wait_started(3)  # warm-up, the request above, then this batch
        queued = asyncio.create_task(others.post("/predict", json={"instances": [row(2), row(3)]}))
        async with asyncio.timeout(5):
            while state.batcher.queued_rows < 2:
                await asyncio.sleep(0.001)
        seen = counting.http
        v1 = await client.post(
            "/v1/models/fake:predict", json={"instances": [row(4)]}, headers={"X-Request-Id": "r-1"}
        )
        v2 = await client.post("/v2/models/fake/versions/1/infer", content=b"not even json")
        plain = await client.post("/predict", json={"instances": [row(5)]})
        assert counting.http == seen  # none of the three reached the app
        # What the app answers itself still reaches it, on the same kept-alive connection.
        other_model = await client.post("/v1/models/nope:predict", json={"instances": [row(6)]})
        too_big = await client.post("/predict", content=b"x" * 5000)
        health = await client.get("/healthz")
        assert counting.http == seen + 3
        gate.set()
        assert (await first).status_code == 200 and (await queued).status_code == 200
        metrics = (await client.get("/metrics")).text
    for r in (v1, v2, plain):
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert r.headers["content-type"] == "application/json"
        assert assert_clean_error(r) == "queue full: 2 rows queued, max_queue_rows=2"
    assert v1.headers["x-request-id"] == "r-1"
    assert len(plain.headers["x-request-id"]) == 24
    assert [other_model.status_code, too_big.status_code, health.status_code] == [404, 413, 200]
    assert 'shardserve_rejects_total{reason="queue_full"} 3.0' in metrics
    assert 'shardserve_request_latency_seconds_count{status="503"} 3.0' in metrics


async def test_with_a_user_middleware_the_app_refuses() -> None:
    """A user's middleware (CORS, auth) must see every answer: no refusal below it."""
    gate = asyncio.Event()
    runner = FakeRunner()
    seen: list[str] = []
    async with (
        running(runner, seen) as (client, _, state),
        httpx.AsyncClient(base_url=str(client.base_url), timeout=10) as others,
    ):
        assert (await client.post("/predict", json={"instances": [row(9)]})).status_code == 200
        runner.gate = gate
        first = asyncio.create_task(others.post("/predict", json={"instances": [row(0), row(1)]}))
        await runner.wait_started(3)
        queued = asyncio.create_task(others.post("/predict", json={"instances": [row(2), row(3)]}))
        async with asyncio.timeout(5):
            while state.batcher.queued_rows < 2:
                await asyncio.sleep(0.001)
        refused = await client.post("/predict", json={"instances": [row(4)]})
        gate.set()
        assert (await first).status_code == 200 and (await queued).status_code == 200
    assert refused.status_code == 503
    assert refused.headers["x-user-middleware"] == "1"
    assert seen.count("POST /predict") == 4


async def test_a_hang_up_drops_the_queued_rows_without_a_watcher_task() -> None:
    gate = asyncio.Event()
    runner = FakeRunner()
    async with (
        running(runner) as (client, _, state),
        httpx.AsyncClient(base_url=str(client.base_url), timeout=10) as others,
    ):
        assert (await client.post("/predict", json={"instances": [row(9)]})).status_code == 200
        runner.gate = gate
        first = asyncio.create_task(others.post("/predict", json={"instances": [row(0), row(1)]}))
        await runner.wait_started(3)  # the only in-flight slot is now held
        tasks_before = asyncio.all_tasks()
        port = client.base_url.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"instances": [[7.0, 1.0, 2.0, 3.0]]}'
        writer.write(
            b"POST /predict HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        async with asyncio.timeout(5):
            while state.batcher.queued_rows < 1:
                await asyncio.sleep(0.001)
        # The request's own task, waiting on the batcher, and no task waiting in receive()
        # for a hang-up (other tasks may come and go meanwhile: only these are looked for).
        chains = {t: awaiting(t) for t in asyncio.all_tasks() - tasks_before}
        request = [t for t, chain in chains.items() if "Batcher.submit" in chain]
        assert len(request) == 1, chains
        assert not [c for c in chains.values() if "RequestResponseCycle.receive" in c], chains
        writer.close()  # the client hangs up while its row is still queued
        async with asyncio.timeout(5):
            while state.batcher.queued_rows:
                await asyncio.sleep(0.001)
            await asyncio.wait(request)  # and the request's task ends: nothing left behind
        gate.set()
        assert (await first).status_code == 200
        metrics = (await client.get("/metrics")).text
        del reader
    assert all(7 not in b["x"][:, 0] for b in runner.batches)
    assert 'shardserve_rejects_total{reason="client_gone"} 1.0' in metrics


async def test_a_refused_body_still_arriving_is_discarded_and_the_connection_reused() -> None:
    gate = asyncio.Event()
    runner = FakeRunner()
    async with (
        running(runner) as (client, _, state),
        httpx.AsyncClient(base_url=str(client.base_url), timeout=10) as others,
    ):
        assert (await client.post("/predict", json={"instances": [row(9)]})).status_code == 200
        runner.gate = gate
        first = asyncio.create_task(others.post("/predict", json={"instances": [row(0), row(1)]}))
        await runner.wait_started(3)
        queued = asyncio.create_task(others.post("/predict", json={"instances": [row(2), row(3)]}))
        async with asyncio.timeout(5):
            while state.batcher.queued_rows < 2:
                await asyncio.sleep(0.001)
        reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        body = b'{"instances": [[1.0, 1.0, 2.0, 3.0]]}' + b" " * 3000
        writer.write(
            b"POST /predict HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body[:1000])
        )
        await writer.drain()
        async with asyncio.timeout(5):  # answered before the rest of its body is sent
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            refused = await reader.readexactly(length)
        writer.write(body[1000:] + b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(5):
            health = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        gate.set()
        assert (await first).status_code == 200 and (await queued).status_code == 200
    assert head.startswith(b"HTTP/1.1 503 ")
    assert orjson.loads(refused) == {"error": "queue full: 2 rows queued, max_queue_rows=2"}
    assert health.startswith(b"HTTP/1.1 200 ")
