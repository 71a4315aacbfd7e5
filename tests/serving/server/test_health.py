"""What the HTTP API says about replica health and poison rows, with the fake runner."""

from __future__ import annotations

import asyncio

from shards.errors import ReplicaRecoveringError
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


async def test_readyz_stays_200_while_requests_wait_for_a_replica_being_brought_back() -> None:
    runner = FakeRunner()
    async with serve(runner, max_batch_size=1, max_inflight_batches=1, max_queue_rows=2) as client:
        model = client.shardserve.model()  # type: ignore[attr-defined]
        back: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        # The only replica lost a stage actor; Ray restarts it, expected back in 5 s.
        runner.fail_with = ReplicaRecoveringError("no healthy replica of 1", 5.0, back, True)
        runner.healthy, runner.recovering, runner.back_in_s = 0, True, 5.0
        held = asyncio.ensure_future(client.post("/predict", json={"instances": [row(0)]}))
        async with asyncio.timeout(10):
            while model.batcher.held_rows != 1:
                await asyncio.sleep(0.001)

        assert (await client.get("/readyz")).status_code == 200  # a Service keeps the pod
        assert (await client.get("/v2/health/ready")).status_code == 200
        assert metric((await client.get("/metrics")).text, "shardserve_held_rows") == 1.0
        status = (await client.get(f"/v1/models/{model.name}")).json()["model_version_status"]
        assert [(v["state"], v["replicas"]) for v in status] == [
            ("AVAILABLE", {"total": 1, "healthy": 0})
        ]  # what /readyz says, with the replica counts saying why
        runner.back_in_s = 60.0  # past the 30 s a request may wait: no more
        r = await client.get("/readyz")
        assert r.status_code == 503
        assert assert_clean_error(r).startswith(
            "no healthy replica of 1; rebuilding, expected back in 60 s, past a request's deadline"
        )
        status = (await client.get(f"/v1/models/{model.name}")).json()["model_version_status"]
        assert [v["state"] for v in status] == ["LOADING"]
        runner.back_in_s = 5.0
        queued = [
            asyncio.ensure_future(client.post("/predict", json={"instances": [row(i)]}))
            for i in (1, 2)
        ]
        async with asyncio.timeout(10):
            while model.batcher.queued_rows != 2:  # the held row is not counted
                await asyncio.sleep(0.001)
        r = await client.get("/readyz")
        assert r.status_code == 503  # the queue is full: it cannot take more
        assert "the queue is full" in assert_clean_error(r)

        runner.fail_with, runner.healthy, runner.recovering = None, 1, False
        back.set_result(None)  # the replica rejoined
        answers = await asyncio.gather(held, *queued)
        assert [a.status_code for a in answers] == [200] * 3
        assert [a.json()["predictions"] for a in answers] == [[expected_row(i)] for i in range(3)]
        assert (await client.get("/readyz")).status_code == 200


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
