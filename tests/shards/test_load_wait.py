"""A load that cannot get its resources says so and ends: the resolve task runs while the shard
actors hold every CPU, ``/readyz`` names the placement the load waits for beside what the
cluster has free, and ``load_timeout_s`` ends the wait with that reason (issue 17 item 9)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
from asgi_lifespan import LifespanManager
from ray.util.placement_group import placement_group, remove_placement_group

from serving.server.app import create_app
from serving.settings.config import Settings
from shards.cluster import pending_placement
from shards.partition.cut import partition_to_bundle
from shards.partition.demo_models import demo_tiny
from shards.source.remote import resolve_bundle_remote
from shards.source.resolve import ResolveOptions

# Long enough for the resolve task (a bundle directory: no TensorFlow) and a few looks of the
# load's watcher on a busy machine; the test's own time is about this.
LOAD_TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    partition_to_bundle(demo_tiny(), out, stages=1)
    return out


@pytest.fixture
def every_cpu_held(ray_address: str) -> Iterator[float]:
    """Hold every CPU of the session Ray, as a private Ray's shard actors do; yield the
    cluster's CPU count. (Placed once the actors of earlier tests are gone.)"""
    cpus = ray.cluster_resources()["CPU"]
    group = placement_group([{"CPU": cpus}])
    try:
        ray.get(group.ready(), timeout=60)
        yield cpus
    finally:
        remove_placement_group(group)


async def test_the_resolve_task_runs_while_every_cpu_is_held(
    every_cpu_held: float, bundle: Path, tmp_path: Path
) -> None:
    resolved = await asyncio.wait_for(
        resolve_bundle_remote(
            str(bundle), ResolveOptions(stages=None, max_stage_bytes=None, cache_dir=tmp_path)
        ),
        30,
    )

    assert resolved == bundle


async def test_a_load_waiting_for_cpus_says_so_on_readyz_then_fails_at_the_timeout(
    every_cpu_held: float, bundle: Path, tmp_path: Path
) -> None:
    settings = Settings(
        model=str(bundle), cpus_per_shard=1, load_timeout_s=LOAD_TIMEOUT_S, cache_dir=tmp_path
    )
    failures: list[str] = []
    app = create_app(settings, on_load_failure=failures.append)
    model = None
    async with LifespanManager(app) as manager:
        model = app.state.shardserve.model()
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            waiting = await _readyz_reason(client, LOAD_TIMEOUT_S + 10)
            refused = await client.post("/predict", json={"instances": [[0.0] * 8]})
            await asyncio.wait_for(model.until_loaded(), LOAD_TIMEOUT_S + 10)
            failed = await client.get("/readyz")

    # What it asks (its CPU and its memory plan) beside what is free of each, in one line.
    asked = r"placement group of \{CPU: 1, memory: [0-9.]+ MiB\}"
    free_now = rf"cluster has CPU 0/{every_cpu_held:g} free, memory [0-9.]+ GiB/[0-9.]+ GiB free"
    assert re.fullmatch(f"waiting for resources: {asked}; {free_now}", waiting), waiting
    assert refused.status_code == 503
    assert refused.json()["error"].startswith(f"model is still loading ({waiting})")
    assert failed.status_code == 503 and failed.json()["status"] == "failed"
    assert failures == [failed.json()["error"]]
    assert failures[0] == (
        f"the model did not load within load_timeout_s={LOAD_TIMEOUT_S:g} s ({waiting}); "
        "free or add those resources, or raise load_timeout_s"
    )
    assert model is not None and model.runner is None
    assert pending_placement() is None  # the abandoned placement group was removed


async def _readyz_reason(client: httpx.AsyncClient, timeout_s: float) -> str:
    """The first reason /readyz gives while loading; fails the test past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = (await client.get("/readyz")).json()
        assert body["status"] == "loading", body
        if body.get("error"):
            return str(body["error"])
        await asyncio.sleep(0.1)  # polling the server's own answer; there is no event to await
    raise AssertionError(f"/readyz gave no reason within {timeout_s:g} s of loading")
