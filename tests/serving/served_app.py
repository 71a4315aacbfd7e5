"""An app served in process over a fake runner, through httpx's ASGI transport (no Ray, no
TensorFlow, no socket), and the rows the tests send it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
from asgi_lifespan import LifespanManager

from serving.server.app import create_app
from serving.settings.config import Settings
from tests.fakes import WAIT_S, FakeRunner, expected_outputs


@contextlib.asynccontextmanager
async def serve(
    runner: FakeRunner, *, wait_ready: bool = True, **overrides: Any
) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        model="fake", **{"batch_timeout_ms": 1000.0, "max_batch_size": 4, **overrides}
    )

    async def factory(_: Settings) -> FakeRunner:
        return runner

    app = create_app(settings, factory)
    async with LifespanManager(app) as manager:
        if wait_ready:
            await asyncio.wait_for(app.state.shardserve.model().until_ready(), WAIT_S)
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            # The server's state, for tests that look inside (client.shardserve.model()).
            client.shardserve = app.state.shardserve  # type: ignore[attr-defined]
            yield client


def row(i: int) -> list[float]:
    return [float(i), 1.0, 2.0, 3.0]


def expected_row(i: int) -> list[float]:
    return expected_outputs({"x": np.array([row(i)], np.float32)})["y"][0].tolist()
