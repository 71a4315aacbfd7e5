"""A batcher loop that crashes, seen through the HTTP API: it is restarted and serves again, and
one that keeps crashing turns every readiness answer to 503 with the reason. Each crash is logged
once with its traceback and counted in ``shardserve_background_errors_total{task="batcher"}``."""

from __future__ import annotations

import logging

import pytest

from serving.batching.batcher import LOOP_MAX_RESTARTS
from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner
from tests.metrics_text import metric
from tests.serving.batching.harness import BuggyWait, buggy_wait
from tests.serving.served_app import expected_row, row, serve


async def crashes_counted(client: object) -> float:
    text = (await client.get("/metrics")).text  # type: ignore[attr-defined]
    return metric(text, "shardserve_background_errors_total", task="batcher")


async def test_readiness_follows_the_batcher_loop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="shardserve")
    buggy_wait(monkeypatch, crashes=1)
    async with serve(FakeRunner(), max_batch_size=2, batch_timeout_ms=60_000.0) as client:
        batcher = client.shardserve.model().batcher  # type: ignore[attr-defined]
        wait: BuggyWait = batcher._wait
        # One crash: the request it held fails, and the loop is back for the next ones.
        crashed = await client.post("/predict", json={"instances": [row(0)]})
        assert crashed.status_code == 500
        assert assert_clean_error(crashed).startswith("the batcher failed")
        assert (await client.get("/readyz")).status_code == 200
        assert (await client.get("/healthz")).json() == {"status": "alive"}
        assert await crashes_counted(client) == 1.0
        logged = [r for r in caplog.records if r.getMessage().startswith("the batcher loop failed")]
        assert len(logged) == 1 and logged[0].exc_info is not None  # once, with its traceback
        served = await client.post("/predict", json={"instances": [row(1), row(2)]})
        assert served.json()["predictions"] == [expected_row(1), expected_row(2)]

        wait.crashes = None  # from now on the loop crashes on every lone row
        for i in range(LOOP_MAX_RESTARTS):
            r = await client.post("/predict", json={"instances": [row(i)]})
            assert r.status_code == 500
        failure = batcher.failure
        assert failure is not None and "crashed 4 times in 60 s" in failure
        assert await crashes_counted(client) == 4.0

        ready = await client.get("/readyz")
        assert (ready.status_code, ready.json()) == (503, {"status": "failed", "error": failure})
        # Gone for good in this process: liveness fails too, so an orchestrator restarts it.
        alive = await client.get("/healthz")
        assert (alive.status_code, alive.json()) == (503, {"status": "failed", "error": failure})
        assert (await client.get("/v2/health/ready")).status_code == 503
        assert (await client.get("/v2/models/fake/ready")).status_code == 503
        status = (await client.get("/v1/models/fake")).json()["model_version_status"][0]
        assert (status["state"], status["status"]["error_message"]) == ("END", failure)
        refused = await client.post("/predict", json={"instances": [row(1), row(2)]})
        assert refused.status_code == 503
        assert assert_clean_error(refused) == failure
