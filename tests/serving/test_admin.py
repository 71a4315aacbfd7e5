"""Admin routes: off without a token, bearer auth, reading and changing the batching policy."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from serving.app import create_app
from serving.config import Settings
from tests.fakes import FakeRunner, expected_outputs, make_rows

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextlib.asynccontextmanager
async def serve(runner: FakeRunner, **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        model="fake",
        **{"admin_token": TOKEN, "batch_timeout_ms": 1000.0, "max_batch_size": 4, **overrides},
    )

    async def factory(_: Settings) -> FakeRunner:
        return runner

    app = create_app(settings, factory)
    async with LifespanManager(app) as manager:
        await app.state.shardserve.ready.wait()
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


async def test_admin_routes_are_off_without_a_token() -> None:
    async with serve(FakeRunner(), admin_token=None) as client:
        r = await client.get("/admin/batching", headers=AUTH)
    assert r.status_code == 404
    assert r.json() == {
        "error": "admin routes are off; start the server with --admin-token to use them"
    }


@pytest.mark.parametrize(
    ("headers", "status", "error"),
    [
        ({}, 401, "admin routes need the header 'Authorization: Bearer <admin token>'"),
        (
            {"Authorization": f"Basic {TOKEN}"},
            401,
            "admin routes need the header 'Authorization: Bearer <admin token>'",
        ),
        (
            {"Authorization": "Bearer nope"},
            403,
            "the bearer token does not match the server's admin token",
        ),
    ],
)
async def test_admin_routes_want_the_bearer_token(
    headers: dict[str, str], status: int, error: str
) -> None:
    async with serve(FakeRunner()) as client:
        got = await client.get("/admin/batching", headers=headers)
        put = await client.put("/admin/batching", headers=headers, json={"max_batch_size": 2})
        after = await client.get("/admin/batching", headers=AUTH)
    assert (got.status_code, got.json()) == (status, {"error": error})
    assert (put.status_code, put.json()) == (status, {"error": error})
    assert after.json()["max_batch_size"] == 4


async def test_get_shows_the_policy() -> None:
    async with serve(FakeRunner(), slo_p99_ms=50) as client:
        r = await client.get("/admin/batching", headers=AUTH)
    assert r.status_code == 200
    assert r.json() == {
        "max_batch_size": 4,
        "batch_timeout_ms": 1000.0,
        "max_inflight_batches": 2,  # 1 stage + 1 being handed over
        "max_queue_rows": 32,
        "slo_p99_ms": 50.0,
        "effective_wait_ms": 1000.0,
        "queued_rows": 0,
        "inflight_batches": 0,
        "padding": False,  # a CPU runner: batches run at their row count
        "run_time_ms": {
            "from_compute": False,
            "hop": 0.0,
            "latency": {"1": None, "2": None, "4": None},
            "bottleneck": {"1": None, "2": None, "4": None},
        },
    }


async def test_put_changes_the_policy_and_derived_limits() -> None:
    async with serve(FakeRunner()) as client:
        r = await client.put(
            "/admin/batching",
            headers=AUTH,
            json={"max_batch_size": 8, "batch_timeout_ms": "auto", "max_inflight_batches": 2},
        )
        after = await client.get("/admin/batching", headers=AUTH)
    assert r.status_code == 200
    assert r.json() == after.json()
    view = after.json()
    assert (view["max_batch_size"], view["batch_timeout_ms"], view["max_inflight_batches"]) == (
        8,
        "auto",
        2,
    )
    assert view["max_queue_rows"] == 4 * 8 * 2  # the default queue scales as at start-up


async def test_put_applies_to_the_next_batch_without_dropping_queued_rows() -> None:
    gate = asyncio.Event()
    gate.set()  # let the warm-up batch through, then hold the next ones
    runner = FakeRunner(gate=gate)
    async with serve(runner, batch_timeout_ms=0, max_batch_size=2) as client:
        gate.clear()
        runner.batches.clear()
        first = asyncio.create_task(
            client.post("/predict", json={"instances": make_rows(1)["x"].tolist()})
        )
        await runner.wait_started(2)  # one row is in flight, the gate holds it
        queued = [
            asyncio.create_task(
                client.post("/predict", json={"instances": make_rows(1, start=i)["x"].tolist()})
            )
            for i in (1, 2, 3)
        ]
        while (await client.get("/admin/batching", headers=AUTH)).json()["queued_rows"] < 3:
            await asyncio.sleep(0)  # yield until the three requests reach the queue
        r = await client.put("/admin/batching", headers=AUTH, json={"max_batch_size": 4})
        assert r.status_code == 200
        gate.set()
        responses = await asyncio.gather(first, *queued)
    assert [x.status_code for x in responses] == [200] * 4
    for i, response in enumerate(responses):
        want = expected_outputs(make_rows(1, start=i))["y"][0].tolist()
        assert response.json()["predictions"][0] == pytest.approx(want)
    assert runner.batch_sizes() == [
        1,
        3,
    ]  # the 3 queued rows went as one batch (a CPU runner: unpadded)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"batch_timeout_ms": "soon"}, "batch_timeout_ms must be a number of ms >= 0 or 'auto'"),
        ({"batch_timeout_ms": -1}, "batch_timeout_ms must be a number >= 0 or None (auto), got -1"),
        ({"max_batch_size": 0}, "max_batch_size must be an integer >= 1, got 0"),
        ({"max_inflight_batches": "2"}, "max_inflight_batches must be an integer >= 1, got '2'"),
        ({"max_queue_rows": 5}, "unknown field(s) ['max_queue_rows']"),
        ({}, "body must be a non-empty JSON object"),
        ([1], "body must be a non-empty JSON object"),
    ],
)
async def test_put_rejects_bad_values_and_keeps_the_policy(body: Any, error: str) -> None:
    async with serve(FakeRunner()) as client:
        before = (await client.get("/admin/batching", headers=AUTH)).json()
        r = await client.put("/admin/batching", headers=AUTH, json=body)
        after = (await client.get("/admin/batching", headers=AUTH)).json()
    assert r.status_code == 400
    assert error in r.json()["error"]
    assert after == before
