"""The compiled-graph option on the session Ray: the same outputs as the whole model through a
graph whose stages read the request and each other, more batches than the graph holds, and a
failing batch that leaves the graph serving the next one."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import keras
import numpy as np
import pytest

from shards.errors import NoHealthyReplicaError, StageTimeoutError
from shards.partition.cut import partition_to_bundle
from shards.pipeline.replica_set import PipelineOptions, ReplicaSet
from tests.shards.model_zoo import Inputs, call_whole, encoder

Case = tuple[Path, keras.Model, Inputs]


@pytest.fixture(scope="module")
def encoder_case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    model, inputs = encoder()
    tmp = tmp_path_factory.mktemp("encoder")
    partition_to_bundle(model, tmp, stages=2)
    return tmp, model, inputs


def _rows(inputs: Inputs, start: int, stop: int) -> Inputs:
    return {name: value[start:stop] for name, value in inputs.items()}


async def test_compiled_graph_matches_the_whole_model_past_its_capacity(
    ray_address: str, encoder_case: Case
) -> None:
    bundle, model, inputs = encoder_case
    options = PipelineOptions(batch_sizes=(1, 3), compiled_graph=True, max_inflight_per_replica=2)
    group = await ReplicaSet.create(bundle, options)
    try:
        assert all(p.compiled is not None for p in group._pipelines)
        # 6 batches at once through a graph that holds 2: the rest wait, none fails.
        batches = [_rows(inputs, i % 3, i % 3 + 1) for i in range(6)]
        outs = await asyncio.gather(*(group.run(b) for b in batches))
        whole = await group.run(inputs)
        # Plain actor calls (the server's stats poller) still run beside the graph.
        calls = [s["calls"] for s in await group.stats()]
    finally:
        await group.close()

    assert calls == [7, 7]  # both stages ran every batch, through the graph
    expected = call_whole(model, inputs)
    for name, want in expected.items():
        np.testing.assert_allclose(whole[name], want, atol=1e-5, rtol=0)
        for i, out in enumerate(outs):
            np.testing.assert_allclose(out[name], want[i % 3 : i % 3 + 1], atol=1e-5, rtol=0)


async def test_a_failing_batch_leaves_the_graph_serving(
    ray_address: str, encoder_case: Case
) -> None:
    bundle, model, inputs = encoder_case
    group = await ReplicaSet.create(bundle, PipelineOptions(batch_sizes=(3,), compiled_graph=True))
    try:
        name = next(iter(inputs))
        bad = {**inputs, name: np.zeros((3, 1, 1, 1), np.float32)}  # the wrong rank
        with pytest.raises(Exception, match=r"(?i)shape|rank|dimension|incompatible"):
            await group.run(bad)
        out = await group.run(inputs)
    finally:
        await group.close()

    for key, want in call_whole(model, inputs).items():
        np.testing.assert_allclose(out[key], want, atol=1e-5, rtol=0)


async def test_a_killed_stage_actor_gets_its_replica_rebuilt(
    ray_address: str, encoder_case: Case
) -> None:
    bundle, model, inputs = encoder_case
    options = PipelineOptions(
        batch_sizes=(3,), compiled_graph=True, max_restarts=0, batch_hard_timeout_s=8.0
    )
    group = await ReplicaSet.create(bundle, options)
    try:
        victim = (await group.describe())[1]["pid"]
        os.kill(victim, signal.SIGKILL)
        # No other replica to retry on: the graph is closed by the death and the batch handed
        # back (a ReplicaRecoveringError: the batcher holds it) while the replica is rebuilt. Ray
        # 2.60 may notice the death only after the watchdog's limit (after 30 s in 2 runs of 2
        # on a quiet machine), so the limit is short: a batch of 3 rows takes milliseconds. Then
        # the stage actors are asked whether they are alive: one Ray knows dead makes the batch
        # lost (held), one that does not answer within a second leaves it the watchdog's (504).
        with pytest.raises((NoHealthyReplicaError, StageTimeoutError)) as refused:
            await group.run(inputs)
        deadline = time.monotonic() + 120
        while group.health().healthy < 1:
            assert time.monotonic() < deadline, group.health()
            await asyncio.sleep(0.05)
        out = await group.run(inputs)
        health = group.health()
        after = [i["pid"] for i in await group.describe()]
    finally:
        await group.close()

    if isinstance(refused.value, NoHealthyReplicaError):
        assert refused.value.retry_after_s >= 1
    assert (health.healthy, health.rebuilds) == (1, 1)
    assert victim not in after
    for key, want in call_whole(model, inputs).items():
        np.testing.assert_allclose(out[key], want, atol=1e-5, rtol=0)
