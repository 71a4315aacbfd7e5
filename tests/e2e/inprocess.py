"""The app in this process, for the e2e tests that look at its state as well as its answers:
``create_app`` under its lifespan (started, then drained and stopped on leaving), every version
it serves at start loaded, and an HTTP client that calls it through the ASGI transport."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from serving.server.state import ServerState
    from serving.settings.config import Settings

LOADED_WITHIN_S = 120.0


@asynccontextmanager
async def app_in_process(
    settings: Settings,
) -> AsyncIterator[tuple[ServerState, httpx.AsyncClient]]:
    """The server's state and a client to it, once the load of every version served at start
    has ended (ready or failed) within ``LOADED_WITHIN_S``."""
    from asgi_lifespan import LifespanManager

    from serving.server.app import create_app

    app = create_app(settings)
    async with LifespanManager(app, startup_timeout=30, shutdown_timeout=60) as manager:
        state: ServerState = app.state.shardserve
        loads = (m.wait_load() for m in state.served())
        await asyncio.wait_for(asyncio.gather(*loads), LOADED_WITHIN_S)
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            yield state, client
