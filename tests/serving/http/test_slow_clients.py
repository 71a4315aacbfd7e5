"""Slow clients against a real uvicorn server in this event loop, over raw sockets: a body that
trickles in ends in a 408 at ``body_read_timeout_s`` with its connection closed (on the fast
routes and the routed ones, and during a SIGTERM drain, which it then no longer holds), or in a
503 at the stop's drain mark where that comes first, and a request on a connection past
``max_connections`` gets a 503."""

from __future__ import annotations

import asyncio
import re
import signal

import orjson
import pytest

from serving.settings.config import ConfigError, load_settings
from serving.version.stop_budget import StopBudget
from tests.fakes import FakeRunner
from tests.serving.http.uvicorn_server import running
from tests.serving.server.test_graceful import raised, serve

__all__ = ["raised"]  # the fixture, found by pytest in this module's names

Answer = tuple[int, dict[bytes, bytes], bytes, bytes]


async def start_trickle(
    port: int,
    *,
    method: bytes = b"POST",
    path: bytes = b"/predict",
    headers: bytes = b"",
    length: int = 1000,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection with a request of a ``length``-byte body, of which 10 bytes are sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"%s %s HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n%s"
        b"content-length: %d\r\n\r\n%s" % (method, path, headers, length, b"1" * 10)
    )
    await writer.drain()
    return reader, writer


async def trickle_until_answered(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, every_s: float | None = 0.05
) -> Answer:
    """Send one more byte of the body every ``every_s`` (``None``: none) until the server
    answers: its status, headers, body, and what came after (``b""`` once it closed the
    connection)."""
    head = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
    try:
        async with asyncio.timeout(30):
            while not head.done():
                if every_s is not None:
                    writer.write(b"1")
                    await writer.drain()
                await asyncio.wait({head}, timeout=every_s)
            status, headers, body = await read_answer(reader, head.result())
            after = await reader.read()
    finally:
        head.cancel()
        writer.close()  # unanswered, the request would hold the server's stop
    return status, headers, body, after


async def read_answer(
    reader: asyncio.StreamReader, head: bytes | None = None
) -> tuple[int, dict[bytes, bytes], bytes]:
    """The status, headers and body of the answer on ``reader`` (``head``: its head, read)."""
    if head is None:
        head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in filter(None, lines):
        name, _, value = line.partition(":")
        headers[name.strip().lower().encode()] = value.strip().encode()
    body = await reader.readexactly(int(headers[b"content-length"]))
    return int(status_line.split()[1]), headers, body


def bytes_came(message: str) -> int:
    found = re.search(r"\((\d+) bytes came\)", message)
    assert found is not None, message
    return int(found[1])


def timed_out(timeout_s: float, came: int) -> str:
    return (
        f"the request body did not arrive within body_read_timeout_s={timeout_s:g} s ({came} "
        "bytes came); send it faster, or raise body_read_timeout_s"
    )


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        (b"POST", b"/predict", b""),
        (b"POST", b"/v2/models/fake/infer", b""),
        (b"PUT", b"/admin/batching", b"authorization: Bearer t\r\n"),  # a routed route
    ],
)
async def test_a_trickled_body_gets_408_and_its_connection_closed(
    method: bytes, path: bytes, headers: bytes
) -> None:
    async with running(body_read_timeout_s=0.5, admin_token="t") as s:
        model = s.app.state.shardserve.model()
        port = s.client.base_url.port
        reader, writer = await start_trickle(port, method=method, path=path, headers=headers)
        status, answer_headers, body, after = await trickle_until_answered(reader, writer)
        # The server is still there for everyone else, and kept nothing of the request.
        health = await s.client.get("/healthz")
        assert (model.admitted.count, model.batcher.queued_rows) == (0, 0)
    assert status == 408
    assert answer_headers[b"connection"] == b"close"
    assert answer_headers[b"content-type"] == b"application/json"
    message = orjson.loads(body)["error"]
    assert message == timed_out(0.5, bytes_came(message))
    # Bytes kept coming (never 0.5 s apart): the limit is on the whole body, not between bytes.
    assert 10 < bytes_came(message) < 1000
    assert after == b""  # closed: nothing more of the request can be read from it
    assert health.status_code == 200
    assert len(s.runner.batches) == 1  # the warm-up only


async def test_a_trickling_client_holds_a_sigterm_drain_only_until_its_body_timeout(
    raised: list[int],
) -> None:
    """Without the body timeout the drain would wait for the request it admitted until the
    stop budget's drain mark (53 s of this 60 s budget)."""
    async with serve(FakeRunner(), body_read_timeout_s=0.5, stop_timeout_s=60) as served:
        model = served.state.model()
        port = served.client.base_url.port
        reader, writer = await start_trickle(port)
        async with asyncio.timeout(5):
            while model.admitted.count != 1:  # admitted: the drain waits for it
                await asyncio.sleep(0.005)
        served.server.handle_exit(signal.SIGTERM, None)
        # Idle, not trickling: this harness runs uvicorn's own protocol, which closes at once
        # after the answer (a byte sent then would be answered with a reset).
        status, _, body, after = await trickle_until_answered(reader, writer, every_s=None)
        async with asyncio.timeout(20):  # the drain, and the whole stop, then end
            await served.serving
    assert (status, after) == (408, b"")
    message = orjson.loads(body)["error"]
    assert message == timed_out(0.5, bytes_came(message))
    assert raised == [signal.SIGTERM]


async def test_the_drain_waits_for_no_body_past_its_timeout() -> None:
    """The same through the drain alone: it ends once the trickler got its 408."""
    async with running(body_read_timeout_s=0.5) as s:
        model = s.app.state.shardserve.model()
        reader, writer = await start_trickle(s.client.base_url.port)
        async with asyncio.timeout(5):
            while model.admitted.count != 1:
                await asyncio.sleep(0.005)
        budget = StopBudget.start(60)
        drain = asyncio.create_task(model.admitted.wait_idle(budget.drain_left()))
        status, _, _, _ = await trickle_until_answered(reader, writer)
        async with asyncio.timeout(10):
            assert await drain is True  # idle, well before the drain mark
    assert status == 408


def cut_by_the_stop(came: int) -> str:
    return (
        "server is shutting down: the request body was still arriving at the end of its drain "
        f"({came} bytes came); send the request again"
    )


async def test_a_body_still_arriving_at_the_drain_mark_gets_503_and_the_stop_goes_on(
    raised: list[int],
) -> None:
    """With the default body_read_timeout_s (30 s) longer than this 3 s stop's drain (to its
    mark at 2.1 s), a trickling client admitted at SIGTERM held the drain to the mark, the
    stop's answer phase to its end, and was then cut without an answer (uvicorn's 500). A
    request on a batch that hangs, held as long, gets its 503 at the mark too."""
    runner = FakeRunner()
    async with serve(runner, stop_timeout_s=3) as served:
        model = served.state.model()
        runner.gate = asyncio.Event()  # never set: every batch from now on hangs
        hung = asyncio.create_task(served.client.post("/predict", json={"instances": [[1] * 4]}))
        await runner.wait_started(2)  # the warm-up's, then its
        reader, writer = await start_trickle(served.client.base_url.port)
        async with asyncio.timeout(5):
            while model.admitted.count != 2:
                await asyncio.sleep(0.005)
        served.server.handle_exit(signal.SIGTERM, None)
        # Idle, as above: uvicorn's own protocol here closes at once after the answer.
        status, headers, body, after = await trickle_until_answered(reader, writer, None)
        async with asyncio.timeout(20):
            on_hung = await hung
            await served.serving
        admitted = model.admitted.count
    assert (status, after, admitted) == (503, b"", 0)
    assert on_hung.status_code == 503
    assert on_hung.json() == {"error": "server is shutting down: the batch was cancelled"}
    assert headers[b"connection"] == b"close"
    message = orjson.loads(body)["error"]
    assert message == cut_by_the_stop(bytes_came(message))
    assert raised == [signal.SIGTERM]


async def test_the_stop_drain_cuts_a_trickling_body_at_its_mark() -> None:
    """The same through the state's drain alone, on shardserve's own protocol (which lingers
    after the answer, so the client may go on sending): the drain ends once the body read it
    cut was answered, well before the answer mark."""
    async with running() as s:  # body_read_timeout_s: the default 30 s
        state = s.app.state.shardserve
        model = state.model()
        reader, writer = await start_trickle(s.client.base_url.port)
        async with asyncio.timeout(5):
            while model.admitted.count != 1:
                await asyncio.sleep(0.005)
        budget = StopBudget.start(1.0)  # the drain mark at 0.7 s
        drain = asyncio.create_task(state.drain(budget))
        status, headers, body, _ = await trickle_until_answered(reader, writer)
        async with asyncio.timeout(10):
            await drain
        left = (model.admitted.count, model.batcher.queued_rows)
    assert (status, headers[b"connection"], left) == (503, b"close", (0, 0))
    message = orjson.loads(body)["error"]
    assert message == cut_by_the_stop(bytes_came(message))
    assert bytes_came(message) > 10  # it was still sending when it was cut


@pytest.mark.parametrize("head", [b"", b"POST /predict HTTP/1.1\r\nhost: t\r\n"])
async def test_a_head_that_does_not_come_gets_408_and_its_connection_closed(head: bytes) -> None:
    """A connection that sends nothing, or a head one header line at a time (never complete):
    uvicorn alone would hold it for ever, one of the max_connections everyone shares."""
    async with running(body_read_timeout_s=0.5) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.client.base_url.port)
        writer.write(head)
        first = asyncio.ensure_future(reader.readuntil(b"\r\n"))
        try:
            async with asyncio.timeout(30):
                while not first.done():
                    if head:
                        writer.write(b"x-more: 1\r\n")
                    await asyncio.wait({first}, timeout=0.05)
                status_line = first.result().rstrip()
                rest = await reader.read()  # until the server closes it
        finally:
            first.cancel()
            writer.close()
        seen = s.counting.http
    assert status_line == b"HTTP/1.1 408 Request Timeout"
    assert b"connection: close" in rest
    assert orjson.loads(rest.partition(b"\r\n\r\n")[2]) == {
        "error": "the request head did not arrive within body_read_timeout_s=0.5 s; send it "
        "whole, or raise body_read_timeout_s"
    }
    assert seen == 0  # never reached the app


async def raw_get(port: int, path: bytes = b"/healthz") -> Answer:
    """A GET on a connection of its own, answered whole; the connection is then left open
    unless the server closed it (``after`` is ``b""``), or else closed here."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET %s HTTP/1.1\r\nhost: t\r\n\r\n" % path)
    await writer.drain()
    async with asyncio.timeout(10):
        status, headers, body = await read_answer(reader)
        after = b"open"
        if headers.get(b"connection") == b"close":
            after = await reader.read()
    writer.close()
    return status, headers, body, after


async def test_a_request_past_max_connections_gets_503_and_its_connection_closed() -> None:
    async with running(max_connections=2) as s:
        port = s.client.base_url.port
        model = s.app.state.shardserve.model()
        # Two connections held open, each in the middle of a request's body.
        holders = []
        try:
            for _ in range(2):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                holders.append(writer)
                writer.write(b"POST /predict HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n{")
                await writer.drain()
            async with asyncio.timeout(10):
                while model.admitted.count != 2:  # both in the app, reading their bodies
                    await asyncio.sleep(0.005)
            seen = s.counting.http
            status, headers, body, after = await raw_get(port)
            assert s.counting.http == seen  # refused before the app
            holders.pop().close()
            # Once the server saw the hang-up, a new connection is served again.
            async with asyncio.timeout(10):
                while (served := await raw_get(port))[0] == 503:
                    await asyncio.sleep(0.01)
        finally:
            for writer in holders:
                writer.close()
    assert (status, after) == (503, b"")
    assert headers[b"connection"] == b"close"
    assert headers[b"retry-after"] == b"1"
    assert orjson.loads(body) == {
        "error": "too many open connections: 3 open, max_connections=2; retry later"
    }
    assert served[0] == 200


async def test_sockets_past_max_connections_are_refused_before_they_send_anything() -> None:
    """The cap counts sockets, not requests (issue 37, item 9): a connection made while
    max_connections are open, idle ones included, is answered a 503 at once and closed, where it
    would once be held until its head's timer (and idle sockets bounded only by the fd limit)."""
    async with running(max_connections=2) as s:
        port = s.client.base_url.port
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # sends nothing
            async with asyncio.timeout(10):
                status, headers, body = await read_answer(reader)
                after = await reader.read()  # the server ends it
            writer.close()
            # The two idle ones were counted, not refused: each is served.
            idle_reader, idle_writer = idle[0]
            idle_writer.write(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
            async with asyncio.timeout(10):
                served_idle = await read_answer(idle_reader)
            for _, w in idle:
                w.close()
            # Once the server saw them go, a new connection is served again.
            async with asyncio.timeout(10):
                while (served := await raw_get(port))[0] == 503:
                    await asyncio.sleep(0.01)
        finally:
            for _, w in idle:
                w.close()
    assert (status, after) == (503, b"")
    assert (headers[b"connection"], headers[b"retry-after"]) == (b"close", b"1")
    assert orjson.loads(body) == {
        "error": "too many open connections: 3 open, max_connections=2; retry later"
    }
    assert (served_idle[0], served[0]) == (200, 200)


def test_the_slow_client_settings() -> None:
    settings = load_settings()
    assert (
        settings.body_read_timeout_s,
        settings.max_connections,
        settings.grpc_max_concurrent_rpcs,
    ) == (30.0, 1024, 256)
    assert load_settings(body_read_timeout_s="2.5").body_read_timeout_s == 2.5
    for field, bad in (
        ("body_read_timeout_s", "0"),
        ("max_connections", "0"),
        ("grpc_max_concurrent_rpcs", "0"),
    ):
        with pytest.raises(ConfigError, match=field):
            load_settings(**{field: bad})
