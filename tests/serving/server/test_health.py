"""What the HTTP API says about replica health and poison rows, with the fake runner."""

from __future__ import annotations

import asyncio

from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner
from tests.metrics_text import metric
from tests.serving.served_app import expected_row, row, serve


async def test_readyz_and_model_status_follow_the_healthy_replicas() -> None:
    runner = FakeRunner()
    runner.replicas = 2
    runner.healthy = 2
    async with serve(runner) as client:
        assert (await client.get("/readyz")).status_code == 200
        status = (await client.get("/v1/models/fake")).json()
        assert status["replicas"] == {"total": 2, "healthy": 2}

        runner.healthy = 1  # one replica down: still ready, and the status says so
        assert (await client.get("/readyz")).status_code == 200
        assert (await client.get("/v1/models/fake")).json()["replicas"]["healthy"] == 1

        runner.healthy = 0
        r = await client.get("/readyz")
        assert r.status_code == 503
        assert r.json()["status"] == "unavailable"
        assert assert_clean_error(r) == (
            "no healthy replica of 2; rebuilding (last fault: stage 0 died)"
        )
        status = (await client.get("/v1/models/fake")).json()
        assert status["model_version_status"][0]["status"]["error_code"] == "UNAVAILABLE"

        metrics = (await client.get("/metrics")).text
        assert metric(metrics, "shardserve_replicas", state="healthy") == 0.0
        assert metric(metrics, "shardserve_replicas", state="dead") == 2.0


async def test_a_poison_row_gets_422_and_its_batch_mates_their_answers() -> None:
    runner = FakeRunner(poison=True)
    async with serve(runner, max_batch_size=4, batch_timeout_ms=60_000.0) as client:
        rows = [row(i) for i in range(4)]
        rows[2] = [-7.0, 1.0, 2.0, 3.0]
        answers = await asyncio.gather(
            *(client.post("/predict", json={"instances": [r]}) for r in rows)
        )
        state = client.shardserve  # type: ignore[attr-defined]
    # After the drain: the batch's record is written once its reruns are done.
    metrics = state.metrics.render().decode()

    assert [a.status_code for a in answers] == [200, 200, 422, 200]
    assert assert_clean_error(answers[2]) == (
        "the model failed on this input: InvalidArgumentError: indices[0,0] = -7 is not in [0, 10)"
    )
    assert [answers[i].json()["predictions"] for i in (0, 1, 3)] == [
        [expected_row(i)] for i in (0, 1, 3)
    ]
    assert metric(metrics, "shardserve_poison_isolations_total") == 1.0
