"""Admin routes: off without a token, bearer auth, reading and changing the batch settings."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from asgi_lifespan import LifespanManager

from serving.server.app import create_app
from serving.settings.config import Settings
from tests.fakes import FakeRunner, expected_outputs, make_rows
from tests.serving.served_repository import Runners, serve_repository, write_repository

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextlib.asynccontextmanager
async def serve(
    runner: FakeRunner, *, seen: list[Any] | None = None, **overrides: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of an app over ``runner``; ``seen`` gets the served model."""
    settings = Settings(
        model="fake",
        **{"admin_token": TOKEN, "batch_timeout_ms": 1000.0, "max_batch_size": 4, **overrides},
    )

    async def factory(_: Settings) -> FakeRunner:
        return runner

    app = create_app(settings, factory)
    async with LifespanManager(app) as manager:
        await app.state.shardserve.model().until_ready()
        if seen is not None:
            seen.append(app.state.shardserve.model())
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
            "by_length": {},  # a model without a length
        },
        "replicas": None,  # a fixed count: no autoscaler to show
    }


async def test_get_shows_the_cost_per_length_bucket_once_length_padded_batches_ran() -> None:
    seen: list[Any] = []
    async with serve(FakeRunner(), seen=seen) as client:
        runtime = seen[0].batcher._runtime
        runtime.observe(4, 0.020, length=16)  # as the batches of a length-padded model report
        runtime.observe(4, 0.080, length=64)
        r = await client.get("/admin/batching", headers=AUTH)
    assert r.status_code == 200
    view = r.json()["run_time_ms"]
    assert view["latency"]["4"] == 80.0  # the longest bucket measured
    assert view["by_length"]["16"]["latency"]["4"] == 20.0


async def test_put_changes_the_policy_and_derived_limits() -> None:
    async with serve(FakeRunner(), max_batch_size=8) as client:
        r = await client.put(
            "/admin/batching",
            headers=AUTH,
            json={"max_batch_size": 4, "batch_timeout_ms": "auto", "max_inflight_batches": 8},
        )
        after = await client.get("/admin/batching", headers=AUTH)
        fewer = await client.put("/admin/batching", headers=AUTH, json={"max_inflight_batches": 1})
    assert r.status_code == 200
    assert r.json() == after.json()
    view = after.json()
    assert (view["max_batch_size"], view["batch_timeout_ms"], view["max_inflight_batches"]) == (
        4,
        "auto",
        8,
    )
    assert view["max_queue_rows"] == 4 * 4 * 8  # the default queue scales as at start-up
    # ... but never below its start-up rows (4 x 8 x 2): a request that size stays valid.
    assert fewer.json()["max_queue_rows"] == 4 * 8 * 2


async def test_put_applies_to_the_next_batch_without_dropping_queued_rows() -> None:
    gate = asyncio.Event()
    gate.set()  # let the warm-up batch through, then hold the next ones
    runner = FakeRunner(gate=gate)
    async with serve(runner, batch_timeout_ms=0, max_batch_size=4) as client:
        smaller = await client.put("/admin/batching", headers=AUTH, json={"max_batch_size": 2})
        assert smaller.status_code == 200
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


BIG = 227870608614676775305216  # over 64 bits: orjson could not write it back


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"max_batch_size": BIG}, f"max_batch_size must be an integer from 1 to 4, the batch the "
         f"memory plan was made for (restart with a larger --max-batch-size for more), got {BIG}"),
        ({"max_batch_size": 5}, "max_batch_size must be an integer from 1 to 4"),
        ({"max_batch_size": 0}, "max_batch_size must be an integer from 1 to 4"),
        ({"max_batch_size": 2.5}, "max_batch_size must be an integer from 1 to 4, "),
        ({"max_batch_size": None}, "max_batch_size must be an integer from 1 to 4, "),
        ({"batch_timeout_ms": 30000}, "batch_timeout_ms must be a number of ms from 0, below "
         "request_timeout_ms (30000), or 'auto' (or null) for the adaptive wait, got 30000"),
        ({"batch_timeout_ms": -1}, "batch_timeout_ms must be a number of ms from 0"),
        ({"batch_timeout_ms": "soon"}, "batch_timeout_ms must be a number of ms from 0"),
        ({"batch_timeout_ms": True}, "batch_timeout_ms must be a number of ms from 0"),
        ({"max_inflight_batches": 1025}, "max_inflight_batches must be an integer from 1 to 1024"),
        ({"max_inflight_batches": "2"}, "max_inflight_batches must be an integer from 1 to 1024, "
         "got '2'"),
        ({"slo_p99_ms": 0}, "slo_p99_ms must be a number of ms above 0 and up to "
         "request_timeout_ms (30000), or null for none, got 0"),
        ({"slo_p99_ms": 1e12}, "slo_p99_ms must be a number of ms above 0"),
        ({"max_queue_rows": 5}, "unknown field 'max_queue_rows'; expected some of"),
        ({"max_batch_size": 9, "oops": 1}, "max_batch_size must be an integer from 1 to 4"),
        ({}, "body must be a non-empty JSON object"),
        ([1], "body must be a JSON object with some of"),
        (b'{"batch_timeout_ms": 1e400}', "batch_timeout_ms must be a number of ms from 0"),
        (b"{", "body is not valid JSON"),
    ],
)  # fmt: skip
async def test_put_rejects_bad_values_and_keeps_the_policy(body: Any, error: str) -> None:
    sent: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    async with serve(FakeRunner()) as client:
        before = (await client.get("/admin/batching", headers=AUTH)).json()
        r = await client.put("/admin/batching", headers=AUTH, **sent)
        after = (await client.get("/admin/batching", headers=AUTH)).json()
        # What a bad change broke: every route that shows the policy.
        metadata = await client.get("/v1/models/fake/metadata")
        config = await client.get("/v2/models/fake/config")
    assert r.status_code == 400
    assert error in r.json()["error"]
    assert after == before
    assert metadata.status_code == config.status_code == 200
    assert metadata.json()["max_batch_size"] == config.json()["max_batch_size"] == 4


async def test_the_put_schema_and_the_server_agree_on_the_bounds() -> None:
    bodies = [
        {"max_batch_size": 4},
        {"max_batch_size": 5},
        {"max_batch_size": 2.0},
        {"batch_timeout_ms": 29999.5},
        {"batch_timeout_ms": 30000},
        {"batch_timeout_ms": None},
        {"batch_timeout_ms": "auto"},
        {"batch_timeout_ms": "AUTO"},
        {"max_inflight_batches": 1024},
        {"max_inflight_batches": 1025},
        {"slo_p99_ms": 30000},
        {"slo_p99_ms": 30000.5},
        {"slo_p99_ms": None},
        {"max_batch_size": True},
    ]
    async with serve(FakeRunner(), request_timeout_ms=30000) as client:
        doc = (await client.get("/openapi.json")).json()
        schema = doc["paths"]["/admin/batching"]["put"]["requestBody"]["content"]
        validator = jsonschema.Draft202012Validator(schema["application/json"]["schema"])
        for body in bodies:
            r = await client.put("/admin/batching", headers=AUTH, json=body)
            assert r.status_code in (200, 400), r.text
            assert validator.is_valid(body) == (r.status_code == 200), (body, r.text)


async def test_batching_per_model_and_version_held_to_its_own_settings(tmp_path: Path) -> None:
    root = write_repository(
        tmp_path / "repo",
        {"a": ([1, 2], 'max_batch_size = 2\n[versions]\npolicy = "all"\n'), "b": ([1], "")},
    )
    async with serve_repository(root, Runners(), admin_token=TOKEN) as client:
        state = client.shardserve  # type: ignore[attr-defined]
        too_big = await client.put(
            "/admin/models/a/batching", json={"max_batch_size": 3}, headers=AUTH
        )
        b_put = await client.put(
            "/admin/models/b/batching", json={"max_batch_size": 3}, headers=AUTH
        )
        a1_put = await client.put(
            "/admin/models/a/versions/1/batching", json={"max_inflight_batches": 1}, headers=AUTH
        )
        a2 = await client.get("/admin/models/a/batching", headers=AUTH)
        unknown = await client.get("/admin/models/zz/batching", headers=AUTH)
        no_default = await client.get("/admin/batching", headers=AUTH)
        bare = await client.get("/admin/models/a/batching")
    assert too_big.status_code == 400
    assert "max_batch_size must be an integer from 1 to 2" in too_big.json()["error"]
    assert (b_put.status_code, b_put.json()["max_batch_size"]) == (200, 3)
    assert state.model("b").batcher.settings.max_batch_size == 3
    assert a1_put.json()["max_inflight_batches"] == 1
    a_versions = [state.model("a", v).batcher.settings.max_inflight_batches for v in ("1", "2")]
    assert a_versions[0] == 1 and a_versions[1] != 1  # version 2 untouched
    assert a2.json()["max_batch_size"] == 2  # a's own plan, not the server's 4
    assert unknown.status_code == 404 and "'a', 'b'" in unknown.json()["error"]
    assert no_default.status_code == 400  # two models, no --default-model
    assert bare.status_code == 401
