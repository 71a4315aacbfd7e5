"""Start-up of the real runner: Ray's start must not hold the event loop (issue 17, item 13).

Ray is faked here (its start blocks until the test lets it go, then fails): what is under test
is that the server answers while that start is under way."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from asgi_lifespan import LifespanManager

from serving.server.app import create_app
from serving.settings.config import Settings
from serving.version.runner import build_runner
from shards import cluster as runtime

# What a fake Ray start waits at most: without the fix the event loop is held this long.
HOLD_S = 5.0


async def test_healthz_answers_while_ray_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    starting, release = threading.Event(), threading.Event()

    def slow_connect(address: str | None, **_: object) -> str:
        starting.set()
        try:
            release.wait(HOLD_S)
            raise RuntimeError("no Ray in this test")
        finally:
            starting.clear()

    monkeypatch.setattr(runtime, "connect", slow_connect)
    app = create_app(Settings(model="demo-tiny", grpc_port=0), build_runner)
    try:
        async with LifespanManager(app) as manager:
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                # The loader task gets to Ray's start at its first step after start-up.
                began = await asyncio.to_thread(_wait_set, starting, HOLD_S)
                assert began, "Ray's start was over before the test could ask /healthz"
                health = await client.get("/healthz")
                ready = await client.get("/readyz")
                still_starting = starting.is_set()
                release.set()
                await asyncio.wait_for(app.state.shardserve.model().until_loaded(), HOLD_S)
    finally:
        release.set()
    assert health.status_code == 200
    assert (ready.status_code, ready.json()["status"]) == (503, "loading")
    assert still_starting, "/healthz answered only once Ray's start was over"
    assert "no Ray in this test" in (app.state.shardserve.model().reason or "")


def _wait_set(event: threading.Event, timeout_s: float) -> bool:
    return event.wait(timeout_s)
