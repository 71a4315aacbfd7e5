"""HTTP behaviour through httpx + ASGI transport, with the fake runner (no Ray, no TensorFlow)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from asgi_lifespan import LifespanManager

from serving.errors import from_runner
from serving.http.replies import as_response, error_reply
from serving.server.app import create_app
from serving.settings.config import Settings
from shards.errors import NoHealthyReplicaError, StageTimeoutError
from shards.signature import ModelSignature, TensorSpec
from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner, expected_outputs
from tests.metrics_text import metric
from tests.serving.served_app import expected_row, row, serve


async def test_concurrent_requests_share_one_batch() -> None:
    runner = FakeRunner()
    async with serve(runner) as client:
        runner.batches.clear()  # forget the warm-up batch
        responses = await asyncio.gather(
            *(client.post("/predict", json={"instances": [row(i)]}) for i in range(4))
        )
    assert [r.status_code for r in responses] == [200] * 4
    assert [r.json()["predictions"] for r in responses] == [[expected_row(i)] for i in range(4)]
    assert runner.batch_sizes() == [4]


async def test_named_route_and_columnar_form() -> None:
    async with serve(FakeRunner(), batch_timeout_ms=0) as client:
        r = await client.post("/v1/models/fake:predict", json={"inputs": [row(1), row(2)]})
        assert r.status_code == 200
        assert r.json() == {"outputs": [expected_row(1), expected_row(2)]}
        r = await client.post("/v1/models/other:predict", json={"inputs": [row(1)]})
        assert r.status_code == 404
        assert assert_clean_error(r) == "model 'other' not found; this server serves 'fake'"


@pytest.mark.parametrize(
    ("content", "headers", "status", "message"),
    [
        (b"{oops", {}, 400, "body is not valid JSON"),
        (b'{"rows": [[1, 2, 3, 4]]}', {}, 400, "unknown key(s) ['rows']"),
        (
            b'{"instances": [[1, 2, 3]]}',
            {},
            400,
            "input 'x' has shape (1, 3); expected (n, 4) float32",
        ),
        (b'{"instances": [[1, 2, 3, 4], [1, 2]]}', {}, 400, "every row the same shape"),
        (b'{"instances": [["a", "b", "c", "d"]]}', {}, 400, "holds strings"),
        (b'{"instances": []}', {}, 400, '"instances" is empty'),
        (
            b'{"instances": [{"y": [1, 2, 3, 4]}]}',
            {},
            400,
            "unknown input(s) ['y']; expected ['x']",
        ),
        (
            b'{"instances": [[1, 2, 3, 4]]}',
            {"x-request-timeout-ms": "soon"},
            400,
            "X-Request-Timeout-Ms",
        ),
        (
            b'{"instances": [' + b"[1, 2, 3, 4]," * 400 + b"[1, 2, 3, 4]]}",
            {},
            413,
            "over the limit of 4096 bytes",
        ),
    ],
)
async def test_bad_input_gets_4xx_with_reason(
    content: bytes, headers: dict[str, str], status: int, message: str
) -> None:
    async with serve(FakeRunner(), batch_timeout_ms=0, max_body_bytes=4096) as client:
        r = await client.post(
            "/predict", content=content, headers={"content-type": "application/json", **headers}
        )
    assert r.status_code == status
    assert message in assert_clean_error(r)


async def test_a_request_refused_at_decode_never_reaches_its_would_be_batch() -> None:
    # (Batch-mates of a request the model itself fails on: tests/serving/server/test_health.py.)
    runner = FakeRunner()
    async with serve(runner) as client:
        runner.batches.clear()
        good = [client.post("/predict", json={"instances": [row(i)]}) for i in range(4)]
        bad = client.post("/predict", json={"instances": [[1, 2]]})
        *goods, bad_r = await asyncio.gather(*good, bad)
    assert bad_r.status_code == 400
    assert "expected (n, 4) float32" in assert_clean_error(bad_r)
    assert [r.json()["predictions"] for r in goods] == [[expected_row(i)] for i in range(4)]
    assert runner.batch_sizes() == [4]


async def test_a_warm_up_failure_is_503_with_the_reason_and_no_stack_trace() -> None:
    runner = FakeRunner(fail_with=RuntimeError("device lost"))
    async with serve(runner, wait_ready=False, batch_timeout_ms=0) as client:
        r = await client.get("/readyz")
        assert r.status_code == 503 and "device lost" in r.json()["error"]  # warm-up failed
        r = await client.post("/predict", json={"instances": [row(1)]})
    assert r.status_code == 503
    assert "model failed to load" in assert_clean_error(r)


async def test_batch_failure_reaches_caller_as_500() -> None:
    runner = FakeRunner()
    async with serve(runner, batch_timeout_ms=0) as client:
        runner.fail_with = ValueError("bad weights")
        r = await client.post("/predict", json={"instances": [row(1)]})
    assert r.status_code == 500
    assert "bad weights" in assert_clean_error(r)


async def test_readyz_is_503_until_loaded() -> None:
    release = asyncio.Event()
    runner = FakeRunner()

    async def slow_factory(_: Settings) -> FakeRunner:
        await release.wait()
        return runner

    app = create_app(Settings(model="fake", batch_timeout_ms=0), slow_factory)
    async with LifespanManager(app) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/healthz")).status_code == 200
            r = await client.get("/readyz")
            assert (r.status_code, r.json()["status"]) == (503, "loading")
            r = await client.post("/predict", json={"instances": [row(1)]})
            assert r.status_code == 503 and "still loading" in assert_clean_error(r)
            release.set()
            await app.state.shardserve.model().until_ready()
            assert (await client.get("/readyz")).status_code == 200
            assert (await client.post("/predict", json={"instances": [row(1)]})).status_code == 200


async def test_queue_full_is_503_with_retry_after() -> None:
    gate = asyncio.Event()
    runner = FakeRunner()
    async with serve(
        runner, batch_timeout_ms=0, max_batch_size=2, max_queue_rows=2, max_inflight_batches=1
    ) as client:
        runner.gate = gate
        first = asyncio.create_task(client.post("/predict", json={"instances": [row(0), row(1)]}))
        await runner.wait_started(2)  # the warm-up was call 1; this batch holds the only slot
        queued = asyncio.create_task(client.post("/predict", json={"instances": [row(2), row(3)]}))
        async with asyncio.timeout(5):
            while runner_queue(client) < 2:
                await asyncio.sleep(0.001)
        r = await client.post("/predict", json={"instances": [row(4)]})
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        assert "queue" in assert_clean_error(r)
        gate.set()
        assert (await first).status_code == 200 and (await queued).status_code == 200


@pytest.mark.parametrize(
    ("raised", "status", "retry_after"),
    [
        (NoHealthyReplicaError("no healthy replica of 1", retry_after_s=7.4), 503, "7"),
        (StageTimeoutError("the batch ran past the watchdog's limit of 5 s"), 504, None),
    ],
)
async def test_a_replica_down_is_503_with_retry_after_and_a_hung_batch_504(
    raised: Exception, status: int, retry_after: str | None
) -> None:
    runner = FakeRunner()
    async with serve(runner, batch_timeout_ms=0) as client:
        runner.fail_with = raised
        v2 = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": row(1)}]}
        for r in (
            await client.post("/predict", json={"instances": [row(1)]}),
            await client.post("/v2/models/fake/infer", json=v2),
        ):
            assert r.status_code == status, r.text
            assert r.headers.get("retry-after") == retry_after
            assert_clean_error(r)
    # The same answer where a user's middleware puts the route behind Starlette's.
    response = as_response(error_reply(from_runner(raised, rows=1), b"-"))
    assert (response.status_code, response.headers.get("retry-after")) == (status, retry_after)


def runner_queue(client: httpx.AsyncClient) -> int:
    return int(client.shardserve.model().batcher.queued_rows)  # type: ignore[attr-defined]


async def test_deadline_header_gives_504_and_rows_are_not_computed() -> None:
    gate = asyncio.Event()
    runner = FakeRunner()
    async with serve(runner, batch_timeout_ms=0, max_inflight_batches=1) as client:
        runner.gate = gate
        first = asyncio.create_task(client.post("/predict", json={"instances": [row(0)]}))
        await runner.wait_started(2)
        r = await client.post(
            "/predict", json={"instances": [row(7)]}, headers={"X-Request-Timeout-Ms": "30"}
        )
        assert r.status_code == 504
        assert "deadline" in assert_clean_error(r)
        gate.set()
        assert (await first).status_code == 200
    assert all(7 not in b["x"][:, 0] for b in runner.batches)


async def test_metadata_status_and_metrics() -> None:
    sig = ModelSignature(
        "fake",
        (TensorSpec("a", (2,), "float32"), TensorSpec("b", (None,), "int32")),
        (TensorSpec("y", (2,), "float32"),),
    )
    async with serve(FakeRunner(sig), batch_timeout_ms=0) as client:
        meta = (await client.get("/v1/models/fake/metadata")).json()
        assert meta["inputs"] == [
            {"name": "a", "shape": [2], "dtype": "float32"},
            {"name": "b", "shape": [None], "dtype": "int32"},
        ]
        assert meta["max_batch_size"] == 4 and meta["num_stages"] == 1
        status = (await client.get("/v1/models/fake")).json()
        assert status["model_version_status"][0]["state"] == "AVAILABLE"
        r = await client.post("/predict", json={"instances": [{"a": [1, 2], "b": [3, 4, 5]}]})
        assert r.status_code == 200
        assert r.json()["predictions"][0] == [15.0, 5.0]
        text = (await client.get("/metrics")).text
    assert metric(text, "shardserve_request_latency_seconds_count", status="200") == 1.0
    assert "shardserve_batch_size_rows_bucket" in text
    # One lone row under a 1 s timeout: its batch closed on the timer, and on nothing else.
    assert metric(text, "shardserve_batch_close_total", reason="timeout") == 1.0
    assert text.count("shardserve_batch_close_total{") == 1
    assert "shardserve_queue_rows" in text


async def test_client_disconnect_drops_its_queued_rows() -> None:
    gate = asyncio.Event()
    runner = FakeRunner()
    settings = Settings(model="fake", batch_timeout_ms=0, max_inflight_batches=1)

    async def factory(_: Settings) -> FakeRunner:
        return runner

    app = create_app(settings, factory)
    async with LifespanManager(app) as manager:
        state = app.state.shardserve
        await state.model().until_ready()
        runner.gate = gate
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            first = asyncio.create_task(client.post("/predict", json={"instances": [row(0)]}))
            await runner.wait_started(2)  # the only in-flight slot is now held

            gone = asyncio.Event()
            sent: list[dict[str, Any]] = []
            body = orjson.dumps({"instances": [row(9)]})
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop()
                await gone.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            scope = http_scope("/predict", [(b"content-type", b"application/json")])
            call = asyncio.create_task(manager.app(scope, receive, send))
            async with asyncio.timeout(5):
                while state.model().batcher.queued_rows < 1:
                    await asyncio.sleep(0.001)
            gone.set()  # the client hangs up while its row is still queued
            async with asyncio.timeout(5):
                await call
            assert state.model().batcher.queued_rows == 0
            gate.set()
            assert (await first).status_code == 200
    assert all(9 not in b["x"][:, 0] for b in runner.batches)


def http_scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "server": ("t", 80), "client": ("c", 1),
        "headers": headers,
    }  # fmt: skip


async def call_without_reading(
    client: httpx.AsyncClient, headers: list[tuple[bytes, bytes]]
) -> tuple[int, dict[bytes, bytes], bytes, int]:
    """POST /predict straight to the ASGI app; returns status, headers, body and how many times
    the app asked for the request body (``receive``)."""
    asked = 0
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal asked
        asked += 1
        if asked > 1:  # the body was sent; the client stays connected
            await never.wait()
        return {"type": "http.request", "body": b'{"instances": [[1, 2, 3, 4]]}'}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    app = client._transport.app  # type: ignore[attr-defined]
    scope = http_scope("/predict", [(b"content-type", b"application/json"), *headers])
    await app(scope, receive, send)
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), body, asked


async def test_request_id_is_echoed_or_generated(caplog: pytest.LogCaptureFixture) -> None:
    async with serve(FakeRunner(), batch_timeout_ms=0) as client:
        ok = await client.post(
            "/predict", json={"instances": [row(1)]}, headers={"X-Request-Id": "job-7:a.b_c"}
        )
        assert (ok.status_code, ok.headers["x-request-id"]) == (200, "job-7:a.b_c")
        first, second = (await client.get("/healthz"), await client.get("/healthz"))
        generated = [first.headers["x-request-id"], second.headers["x-request-id"]]
        assert all(len(g) == 24 and int(g, 16) >= 0 for g in generated)
        assert generated[0] != generated[1]
        # An id that is not a safe token (it would go into the log) is replaced.
        for unsafe in ("a b", "x" * 129, "id\u001b[31m"):
            r = await client.get("/healthz", headers={"X-Request-Id": unsafe})
            assert r.headers["x-request-id"] != unsafe and len(r.headers["x-request-id"]) == 24
        caplog.set_level("INFO", logger="shardserve")
        bad = await client.post(
            "/predict", json={"instances": [[1, 2]]}, headers={"X-Request-Id": "req-bad"}
        )
        missing = await client.get("/no/such/route", headers={"X-Request-Id": "req-404"})
    assert (bad.status_code, bad.headers["x-request-id"]) == (400, "req-bad")
    assert (missing.status_code, missing.headers["x-request-id"]) == (404, "req-404")
    assert_clean_error(bad)
    assert assert_clean_error(missing) == "Not Found"
    lines = {(r.levelname, r.getMessage()) for r in caplog.records}
    assert ("INFO", f"request req-bad: 400 {bad.json()['error']}") in lines
    assert ("INFO", "request req-404: 404 Not Found") in lines


async def test_request_id_reaches_the_batcher() -> None:
    async with serve(FakeRunner(), batch_timeout_ms=0) as client:
        batcher = client.shardserve.model().batcher  # type: ignore[attr-defined]
        seen: list[str | None] = []
        submit = batcher.submit

        async def recording_submit(inputs: Any, **kwargs: Any) -> Any:
            seen.append(kwargs.get("request_id"))
            return await submit(inputs, **kwargs)

        batcher.submit = recording_submit
        r = await client.post(
            "/predict", json={"instances": [row(1)]}, headers={"X-Request-Id": "trace-1"}
        )
    assert r.status_code == 200
    assert seen == ["trace-1"]


async def test_body_over_the_limit_is_413_before_it_is_read() -> None:
    async with serve(FakeRunner(), batch_timeout_ms=0, max_body_bytes=4096) as client:
        status, headers, body, asked = await call_without_reading(
            client, [(b"content-length", b"4097"), (b"x-request-id", b"big-1")]
        )
        ok_status, _, _, ok_asked = await call_without_reading(client, [])
    assert (status, asked) == (413, 0)
    assert headers[b"x-request-id"] == b"big-1"
    assert assert_clean_error(body) == "body of 4097 bytes is over the limit of 4096 bytes"
    assert (ok_status, ok_asked) == (200, 2)  # the same call under the limit is read (and watched)


async def test_queue_full_is_refused_before_the_body_is_read() -> None:
    gate = asyncio.Event()
    runner = FakeRunner()
    async with serve(
        runner, batch_timeout_ms=0, max_batch_size=2, max_queue_rows=2, max_inflight_batches=1
    ) as client:
        runner.gate = gate
        first = asyncio.create_task(client.post("/predict", json={"instances": [row(0), row(1)]}))
        await runner.wait_started(2)
        queued = asyncio.create_task(client.post("/predict", json={"instances": [row(2), row(3)]}))
        async with asyncio.timeout(5):
            while runner_queue(client) < 2:
                await asyncio.sleep(0.001)
        status, headers, body, asked = await call_without_reading(client, [])
        gate.set()
        assert (await first).status_code == 200 and (await queued).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert (status, asked) == (503, 0)
    assert headers[b"retry-after"] == b"1"
    assert assert_clean_error(body) == "queue full: 2 rows queued, max_queue_rows=2"
    assert metric(metrics, "shardserve_rejects_total", reason="queue_full") == 1.0


async def test_large_body_is_answered() -> None:
    sig = ModelSignature(
        "wide", (TensorSpec("x", (8192,), "float32"),), (TensorSpec("y", (2,), "float32"),)
    )
    rows = np.random.default_rng(0).random((4, 8192)).astype(np.float32)
    content = orjson.dumps({"instances": rows.tolist()})
    assert len(content) > 256 * 1024
    async with serve(FakeRunner(sig), batch_timeout_ms=0) as client:
        big = await client.post(
            "/predict", content=content, headers={"content-type": "application/json"}
        )
    assert big.status_code == 200
    want = expected_outputs({"x": rows}, sig)["y"]
    np.testing.assert_allclose(np.asarray(big.json()["predictions"]), want, rtol=1e-6)
