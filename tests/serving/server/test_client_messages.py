"""What reaches a client names the model and the reason, never internals: a crashed batcher's
exception text, a model answer's repr, and the paths and hosts of a failed load stay in the log
(with the request id where there is one)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import numpy as np
import pytest
from asgi_lifespan import LifespanManager

from serving.batching.batcher import Batcher, BatchSettings
from serving.errors import BatchFailedError
from serving.server.app import create_app
from serving.settings.config import Settings
from shards.errors import ResolveError
from tests.errorcheck import assert_clean_error
from tests.fakes import WAIT_S, FakeRunner, make_rows

INTERNALS = (
    "/home/alice/models/m.keras at ip-10-0-0-12.ec2.internal, node-3.cluster.local:6379, "
    "[2001:db8::7]:6379, <Stage object at 0x7f3a2b10>"
)


class CrashingWait:
    """A wait policy that breaks the batcher's loop the first time it is asked."""

    def close_reason(self, *_: Any, **__: Any) -> str | None:
        raise KeyError(INTERNALS)

    def wait_s(self, *_: Any) -> float:
        return 60.0


async def test_a_crashed_batcher_tells_clients_the_reason_not_the_exception_text() -> None:
    batcher = Batcher(FakeRunner().run_batch, BatchSettings(max_batch_size=4))
    await batcher.start()
    batcher._wait = CrashingWait()  # type: ignore[assignment]
    try:
        with pytest.raises(BatchFailedError) as info:
            await asyncio.wait_for(batcher.submit(make_rows(1)), WAIT_S)
    finally:
        await batcher.stop(drain=False)

    assert "the batcher failed (KeyError)" in info.value.message
    assert_clean_error({"error": info.value.message})
    assert "ec2.internal" not in info.value.message and "m.keras" not in info.value.message


class Leaky:
    def __repr__(self) -> str:
        return f"<Leaky {INTERNALS}>"


async def test_a_model_answer_of_the_wrong_type_is_named_by_type_and_logged_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def wrong(_: dict[str, np.ndarray]) -> Any:
        return [Leaky()]

    batcher = Batcher(wrong, BatchSettings(max_batch_size=4, batch_timeout_ms=0))
    await batcher.start()
    try:
        with (
            caplog.at_level(logging.ERROR, logger="shardserve"),
            pytest.raises(BatchFailedError) as info,
        ):
            await batcher.submit(make_rows(1), request_id="req-42")
    finally:
        await batcher.stop(drain=False)

    assert info.value.message == (
        "model returned a list; expected a non-empty dict of output name -> array"
    )
    logged = [r.getMessage() for r in caplog.records if "model returned list" in r.getMessage()]
    assert len(logged) == 1 and "req-42" in logged[0] and "<Leaky /home/alice" in logged[0]


async def test_a_load_failure_on_readyz_names_the_model_file_not_its_path_or_host(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def factory(_: Settings) -> FakeRunner:
        raise ResolveError(f"cannot read {INTERNALS}")

    app = create_app(Settings(model="fake"), factory)
    with caplog.at_level(logging.ERROR, logger="shardserve"):
        async with LifespanManager(app) as manager:
            await asyncio.wait_for(app.state.shardserve.model().until_loaded(), WAIT_S)
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                ready = await client.get("/readyz")
                status = (await client.get("/v1/models/fake")).json()

    assert ready.status_code == 503
    message = assert_clean_error(ready)
    assert message.startswith("ResolveError: cannot read m.keras at")
    assert "alice" not in message
    error_message = status["model_version_status"][0]["status"]["error_message"]
    assert error_message == message
    assert "/home/alice/models/m.keras" in caplog.text  # the detail is in the log
