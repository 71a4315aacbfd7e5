"""A load that never finishes ends at ``load_timeout_s`` with a reason on /readyz, instead of
leaving the server "loading" for ever (with Ray: tests/shards/test_load_wait.py)."""

from __future__ import annotations

import asyncio

import httpx
from asgi_lifespan import LifespanManager

from serving.server.app import create_app
from serving.settings.config import Settings
from tests.errorcheck import assert_clean_error
from tests.fakes import WAIT_S, FakeRunner


async def test_a_load_that_hangs_fails_at_load_timeout_s_and_is_cancelled() -> None:
    cancelled = asyncio.Event()

    async def hanging(_: Settings) -> FakeRunner:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()  # what it holds (placement groups, a resolve) can be released
            raise
        raise AssertionError("unreachable")

    failures: list[str] = []
    app = create_app(
        Settings(model="fake", load_timeout_s=0.2), hanging, on_load_failure=failures.append
    )
    async with LifespanManager(app) as manager:
        state = app.state.shardserve
        await asyncio.wait_for(state.model().until_loaded(), WAIT_S)
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            ready = await client.get("/readyz")

    assert cancelled.is_set()
    assert ready.status_code == 503 and ready.json()["status"] == "failed"
    assert assert_clean_error(ready) == (
        "the model did not load within load_timeout_s=0.2 s; the server log says how far it "
        "got; raise load_timeout_s if it needs longer"
    )
    assert failures == [ready.json()["error"]]
