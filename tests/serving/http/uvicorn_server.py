"""A real uvicorn server on shardserve's protocol, in the test's event loop, and the moves the
protocol's tests share: hold the batcher so that the queue fills, and talk to the server over a
raw socket (to send part of a body, or to hang up)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from starlette.types import Receive, Scope, Send

from serving.http.protocol import http_protocol
from serving.server.app import create_app
from serving.settings.config import Settings
from serving.settings.tls import uvicorn_tls
from tests.fakes import FakeRunner
from tests.serverproc import free_ports
from tests.serving.http.test_fast_routes import Recorder


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


@dataclass
class Running:
    client: httpx.AsyncClient  # one kept-alive connection
    others: httpx.AsyncClient  # a pool, for the requests that hold the queue
    counting: Counting
    runner: FakeRunner
    app: Any

    def queued_rows(self) -> int:
        return int(self.app.state.shardserve.model().batcher.queued_rows)

    async def until_queued(self, test: Callable[[int], bool]) -> None:
        async with asyncio.timeout(5):
            while not test(self.queued_rows()):
                await asyncio.sleep(0.001)

    @contextlib.asynccontextmanager
    async def held(self, queued: bool = True) -> AsyncIterator[None]:
        """The only in-flight batch held by the runner and, with ``queued``, the queue full
        (2 rows of 2); on leaving, both are answered 200."""
        # The first request builds the middleware stack: the app then knows what wraps it.
        r = await self.client.post("/predict", json={"instances": [row(9)]})
        assert r.status_code == 200
        gate = self.runner.gate = asyncio.Event()
        posts = [self.others.post("/predict", json={"instances": [row(0), row(1)]})]
        tasks = [asyncio.create_task(posts[0])]
        await self.runner.wait_started(3)  # warm-up, the request above, then this batch
        if queued:
            second = self.others.post("/predict", json={"instances": [row(2), row(3)]})
            tasks.append(asyncio.create_task(second))
            await self.until_queued(lambda n: n >= 2)
        yield
        gate.set()
        assert [(await t).status_code for t in tasks] == [200] * len(tasks)

    async def raw_post(
        self, body: bytes, *, sent: int | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection of its own with a POST /predict of ``body`` on it, of which only the
        first ``sent`` bytes are sent (all by default)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.client.base_url.port)
        writer.write(
            b"POST /predict HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body[:sent])
        )
        await writer.drain()
        return reader, writer


@contextlib.asynccontextmanager
async def running(
    seen: list[str] | None = None, *, client_tls: ssl.SSLContext | None = None, **overrides: Any
) -> AsyncIterator[Running]:
    """A server on a free port, a queue of 2 rows and one batch in flight; ``seen``: with a
    user's middleware (``Recorder``) noting each request in it; ``client_tls``: how the clients
    talk TLS to a server given a certificate; ``overrides``: more settings."""
    runner = FakeRunner()
    settings = Settings(
        model="fake", **{"batch_timeout_ms": 0, "max_batch_size": 2, "max_queue_rows": 2,
        "max_inflight_batches": 1, "max_body_bytes": 4096, **overrides},
    )  # fmt: skip

    async def factory(_: Settings) -> FakeRunner:
        return runner

    app = create_app(settings, factory)
    if seen is not None:
        app.add_middleware(Recorder, seen=seen)
    counting = Counting(app)
    (port,) = free_ports(1)
    config = uvicorn.Config(
        counting,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        http=http_protocol(app),
        # uvicorn's own logging config binds its handlers to the sys.stderr of the moment: under a
        # test's capsys, a stream closed once that test ends, which a later test's log then hits.
        log_config=None,
        **uvicorn_tls(settings),
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(30):
            while not server.started:
                await asyncio.sleep(0.01)
            await app.state.shardserve.model().until_ready()
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        base = f"{'https' if settings.tls else 'http'}://127.0.0.1:{port}"
        verify: Any = client_tls or True
        async with (
            httpx.AsyncClient(base_url=base, limits=limits, timeout=10, verify=verify) as client,
            httpx.AsyncClient(base_url=base, timeout=10, verify=verify) as others,
        ):
            yield Running(client, others, counting, runner, app)
    finally:
        server.should_exit = True
        await task
