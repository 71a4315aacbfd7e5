"""The reconciler's one change of behaviour: a step that fails is taken again on the next tick.

What a user sees when the retire of an old version raises (its drain, or the end of its actors):
the error is logged once with its traceback and counted in
``shardserve_background_errors_total{task="retire"}``; meanwhile the old version refuses requests
that name it (503 saying it is being unloaded) and the index says so, requests that name no
version go to the new one, and /readyz stays 200; within a tick the retire is taken again and the
old version leaves the index. (Before, the failure was counted as the task that ran the retire, a
settle or a poll, and the whole hand-over was spawned again as a task of its own.)
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from serving.server.state import ServerState
from tests.metrics_text import metric
from tests.serving.repository.test_manager import _until
from tests.serving.repository.test_repository_switch import Versions, add_version, index
from tests.serving.served_app import row
from tests.serving.served_repository import serve_repository


async def test_a_retire_that_raises_is_logged_counted_and_taken_again_on_the_next_tick(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="shardserve")
    add_version(tmp_path, 1)
    versions = Versions()
    async with serve_repository(tmp_path, versions) as client:  # type: ignore[arg-type]
        state: ServerState = client.shardserve  # type: ignore[attr-defined]
        assert state.repository is not None
        old = state.model("m", "1")
        retire, tries, again = old.retire, [], asyncio.Event()

        async def retire_once_failing(reason: str) -> None:
            tries.append(reason)
            if len(tries) == 1:
                old.stop_accepting(reason)
                raise RuntimeError("the drain lost its way")
            await again.wait()  # the test looks at what a user sees meanwhile
            await retire(reason)

        old.retire = retire_once_failing  # type: ignore[method-assign]
        add_version(tmp_path, 2)
        await state.repository.poll_once()
        await _until(lambda: len(tries) == 2)  # failed, then taken again on a later tick
        # Meanwhile: the old version refuses and says why, the new one answers, ready.
        reason = "model 'm' version 1 is being unloaded (no longer selected by its version policy"
        assert index(state)["m/1"][0] == "UNAVAILABLE"
        assert index(state)["m/1"][1].startswith(reason)
        assert index(state)["m/2"] == ("READY", "")
        named = await client.post("/v1/models/m/versions/1:predict", json={"instances": [row(1)]})
        assert named.status_code == 503 and named.json()["error"].startswith(reason)
        unnamed = await client.post("/v1/models/m:predict", json={"instances": [row(1)]})
        assert unnamed.json()["predictions"][0][0] == 2.0
        assert (await client.get("/readyz")).status_code == 200
        again.set()
        # The next tick takes the retire again: the old version goes.
        await _until(lambda: list(state.models["m"]) == ["2"])
        assert len(tries) == 2 and versions.made[1][0].closed  # its second try ended it
        text = state.metrics.render().decode()
        assert metric(text, "shardserve_background_errors_total", task="retire") == 1.0
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is not None
        assert errors[0].getMessage().startswith("model 'm' version 1's retire (no longer sel")
        assert errors[0].getMessage().endswith("failed (RuntimeError: the drain lost its way)")
