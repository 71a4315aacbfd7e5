"""Queue-full refusals answered in uvicorn's protocol (serving.http.protocol), on a real uvicorn
server in this event loop: the answer is the app's own 503, the app never sees the request,
the connection stays usable, and everything the app must answer itself still reaches it."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import orjson

from tests.errorcheck import assert_clean_error
from tests.metrics_text import metric
from tests.serving.http.uvicorn_server import row, running


def awaiting(task: asyncio.Task[Any]) -> list[str]:
    """The coroutines ``task`` is suspended in, outermost first."""
    names = []
    coro: Any = task.get_coro()
    while hasattr(coro, "cr_code"):
        names.append(coro.cr_code.co_qualname)
        coro = coro.cr_await
    return names


async def test_a_full_queue_is_refused_before_the_app() -> None:
    async with running() as s:
        client = s.client
        async with s.held():
            seen = s.counting.http
            v1 = await client.post(
                "/v1/models/fake:predict",
                json={"instances": [row(4)]},
                headers={"X-Request-Id": "r-1"},
            )
            v2 = await client.post("/v2/models/fake/versions/1/infer", content=b"not even json")
            plain = await client.post("/predict", json={"instances": [row(5)]})
            assert s.counting.http == seen  # none of the three reached the app
            # What the app answers itself still reaches it, on the same kept-alive connection.
            other_model = await client.post("/v1/models/nope:predict", json={"instances": [row(6)]})
            too_big = await client.post("/predict", content=b"x" * 5000)
            health = await client.get("/healthz")
            assert s.counting.http == seen + 3
        metrics = (await client.get("/metrics")).text
    for r in (v1, v2, plain):
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert r.headers["content-type"] == "application/json"
        assert assert_clean_error(r) == "queue full: 2 rows queued, max_queue_rows=2"
    assert v1.headers["x-request-id"] == "r-1"
    assert len(plain.headers["x-request-id"]) == 24
    assert [other_model.status_code, too_big.status_code, health.status_code] == [404, 413, 200]
    assert metric(metrics, "shardserve_rejects_total", reason="queue_full") == 3.0
    assert metric(metrics, "shardserve_request_latency_seconds_count", status="503") == 3.0


async def test_with_a_user_middleware_the_app_refuses() -> None:
    """A user's middleware (CORS, auth) must see every answer: no refusal below it."""
    seen: list[str] = []
    async with running(seen) as s, s.held():
        refused = await s.client.post("/predict", json={"instances": [row(4)]})
    assert refused.status_code == 503
    assert refused.headers["x-user-middleware"] == "1"
    assert seen.count("POST /predict") == 4


async def test_a_hang_up_drops_the_queued_rows_without_a_watcher_task() -> None:
    async with running() as s:
        async with s.held(queued=False):  # the only in-flight slot is now held
            tasks_before = asyncio.all_tasks()
            reader, writer = await s.raw_post(b'{"instances": [[7.0, 1.0, 2.0, 3.0]]}')
            await s.until_queued(lambda n: n >= 1)
            # The request's own task, waiting on the batcher, and no task waiting in receive()
            # for a hang-up (other tasks may come and go meanwhile: only these are looked for).
            chains = {t: awaiting(t) for t in asyncio.all_tasks() - tasks_before}
            request = [t for t, chain in chains.items() if "Batcher.submit" in chain]
            assert len(request) == 1, chains
            assert not [c for c in chains.values() if "RequestResponseCycle.receive" in c], chains
            writer.close()  # the client hangs up while its row is still queued
            await s.until_queued(lambda n: n == 0)
            async with asyncio.timeout(5):
                await asyncio.wait(request)  # and the request's task ends: nothing left behind
        metrics = (await s.client.get("/metrics")).text
        del reader
    assert all(7 not in b["x"][:, 0] for b in s.runner.batches)
    assert metric(metrics, "shardserve_rejects_total", reason="client_gone") == 1.0


async def test_a_refused_body_still_arriving_is_discarded_and_the_connection_reused() -> None:
    async with running() as s, s.held():
        body = b'{"instances": [[1.0, 1.0, 2.0, 3.0]]}' + b" " * 3000
        reader, writer = await s.raw_post(body, sent=1000)
        async with asyncio.timeout(5):  # answered before the rest of its body is sent
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            refused = await reader.readexactly(length)
        writer.write(body[1000:] + b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(5):
            health = await reader.readuntil(b"\r\n\r\n")
        writer.close()
    assert head.startswith(b"HTTP/1.1 503 ")
    assert orjson.loads(refused) == {"error": "queue full: 2 rows queued, max_queue_rows=2"}
    assert health.startswith(b"HTTP/1.1 200 ")


async def test_an_answered_request_is_freed_without_the_collector() -> None:
    """A request's uvicorn cycle (its scope, headers, body) goes when its answer is out, by
    reference counting: held in a reference cycle (its transport holding it back), every
    request's was garbage only a collection frees, and under load those piled up between
    collections (issue 37: the front end's RSS at 3x overload)."""
    async with running() as s:
        answers = []
        gc.collect()
        gc.disable()
        try:
            for i in range(4):  # on one kept-alive connection
                answers.append(await s.client.post("/predict", json={"instances": [row(i)]}))
            cycles = [o for o in gc.get_objects() if type(o).__name__ == "RequestResponseCycle"]
        finally:
            gc.enable()
    assert [a.status_code for a in answers] == [200] * 4
    assert len(cycles) <= 1  # the connection's last one, which uvicorn keeps till the next


async def test_a_closed_connection_is_freed_without_the_collector() -> None:
    """A connection and its last cycle hold each other: once it is lost, both go by reference
    counting. Left to the collector, connections that come and go (clients past
    max_connections reconnect at once) piled up between collections (issue 37)."""
    async with running() as s:
        gc.collect()
        gc.disable()
        try:
            for i in range(3):
                reader, writer = await s.raw_post(orjson.dumps({"instances": [row(i)]}))
                async with asyncio.timeout(5):
                    assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200 ")
                writer.close()
                await writer.wait_closed()
            async with asyncio.timeout(5):  # until the server has seen each hang-up
                while [p for p in protocols() if not p.transport.is_closing()]:
                    await asyncio.sleep(0.01)
            left = protocols()
        finally:
            gc.enable()
    assert left == []


def protocols() -> list[Any]:
    """The server's connections still in memory, lost or not (the test's client has none open)."""
    return [o for o in gc.get_objects() if type(o).__name__ == "ShardServeProtocol"]
