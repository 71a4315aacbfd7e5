"""A served version's scaling loop over a fake elastic runner: it starts once READY and ends
with the version's jobs, adds a replica when the queue's wait stays over target (one pending at
a time), removes one when idle, the batching limits follow the healthy replicas (not those the
operator set), and /metrics, the V2 metadata and the admin view show the target and its reason.
A runner that cannot change its count is never scaled; a new version starts at the old one's
count. The private Ray reserves CPUs for the most replicas."""

from __future__ import annotations

import asyncio
from typing import Any

from serving.elastic.count import inherited_settings
from serving.elastic.limits import operator_sets
from serving.elastic.steps import Scaler, observe, scale_step, stop_scaling
from serving.metrics.series import Metrics
from serving.protocols.v2.metadata import model_metadata
from serving.server.admin_routes import batching_view
from serving.server.state import ServerState
from serving.settings.config import Settings
from serving.version.runner import (
    ElasticRunner,
    pipeline_options,
    private_ray_cpus,
)
from serving.version.served import ServedModel
from shards.pipeline.health import Health
from tests.fakes import WAIT_S, FakeRunner, make_rows, put_in_state, spawn
from tests.metrics_text import metric

WAITS = "waiting for resources: placement group of 1 x {GPU: 1}; cluster has GPU 0/0 free"


class ElasticFake(FakeRunner):
    """A fake runner whose replicas can be added (pending until ``place`` is set) and removed
    (draining, then gone)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.states = ["healthy"]
        self.place = asyncio.Event()
        self.removed = 0

    @property  # type: ignore[override]
    def replicas(self) -> int:
        return len(self.states)

    def health(self) -> Health:
        waits = WAITS if "pending" in self.states else ""
        return Health(
            len(self.states), self.states.count("healthy"), tuple(self.states), pending_reason=waits
        )

    async def add_replica(self, pending_timeout_s: float) -> bool:
        self.states.append("pending")
        index = len(self.states) - 1
        try:
            await self.place.wait()
        except asyncio.CancelledError:
            del self.states[index]
            raise
        self.states[index] = "healthy"
        return True

    async def remove_replica(self, drain_timeout_s: float) -> bool:
        index = self.states.index("healthy")
        self.states[index] = "draining"
        await asyncio.sleep(0)
        del self.states[index]
        self.removed += 1
        return True


def elastic_settings(**more: Any) -> Settings:
    values: dict[str, Any] = {
        "model": "fake",
        "batch_timeout_ms": 0.0,
        "min_replicas": 1,
        "max_replicas": 3,
        "target_queue_wait_ms": 0.001,  # any queued row is over it
        "upscale_delay_s": 0,
        "downscale_delay_s": 0,
        "max_batch_size": 4,
        **more,
    }
    return Settings(**values)


async def until(check: Any) -> None:
    async with asyncio.timeout(WAIT_S):
        while not check():
            await asyncio.sleep(0.01)


async def served(settings: Settings, runner: FakeRunner) -> ServedModel:
    model = ServedModel("m", settings, Metrics())

    async def factory(_: Settings) -> FakeRunner:
        return runner

    model.start(factory, None)
    await asyncio.wait_for(model.until_ready(), WAIT_S)
    return model


async def test_the_loop_adds_and_removes_replicas_and_the_limits_follow_the_healthy_ones() -> None:
    gate = asyncio.Event()
    gate.set()  # the warm-up batch goes through
    runner = ElasticFake(gate=gate)
    model = await served(elastic_settings(upscale_delay_s=1, downscale_delay_s=10), runner)
    gate.clear()
    observe(model, 0.0)  # the reconciler's first sample of the READY version: its status
    assert model.scaling is not None
    stop_scaling(model)
    await model.stop_jobs(WAIT_S)
    batcher = model.require_batcher()
    start = batcher.settings
    assert (start.max_inflight_batches, start.pipeline_depth) == (2, 1)

    # Batches hang: 2 in flight, rows queue behind them.
    requests = [await spawn(batcher.submit(make_rows(4, start=i * 4))) for i in range(4)]
    await runner.wait_started(3)  # the warm-up, then 2 batches
    scaler = Scaler(model, runner, batcher)
    assert scaler.tick(0.0).direction == ""  # over target, not for 1 s yet
    up = scaler.tick(1.0)
    assert (up.direction, up.target, up.reason) == ("up", 2, "queue_wait")
    await until(lambda: "pending" in runner.states)
    held = scaler.tick(1.5)  # one pending at a time
    assert held.direction == "" and runner.states == ["healthy", "pending"]
    waiting = model.scaling_parameters()
    assert waiting is not None and waiting["pending"] == WAITS  # what the pending one waits for
    text = model.server_metrics.render().decode()
    labels = {"model": "m", "version": "1"}
    assert metric(text, "shardserve_replicas", **labels, state="pending") == 1.0
    assert metric(text, "shardserve_scale_events_total", **labels, direction="up") == 1.0

    runner.place.set()
    await until(lambda: not scaler.adds)
    scaler.tick(2.0)
    grown = batcher.settings
    assert (grown.max_inflight_batches, grown.pipeline_depth, grown.max_queue_rows) == (4, 2, 64)
    status = model.scaling_parameters()
    assert status is not None
    assert (status["target_replicas"], status["reason"], status["pending"]) == (2, "queue_wait", "")
    assert model_metadata(model)["parameters"]["replicas"] == status
    view = batching_view(batcher, model.scaling_parameters())
    assert view.replicas is not None and view.replicas.target_replicas == 2

    gate.set()  # the backlog clears; idle, it scales down
    await asyncio.gather(*requests)
    assert scaler.tick(3.0).direction == ""  # quiet, not for 10 s yet
    down = scaler.tick(13.0)
    assert (down.direction, down.target, down.reason) == ("down", 1, "low_load")
    await until(lambda: runner.removed == 1)
    scaler.tick(14.0)
    assert batcher.settings == start  # back to the start-up limits
    text = model.server_metrics.render().decode()
    assert metric(text, "shardserve_scale_events_total", **labels, direction="down") == 1.0
    assert metric(text, "shardserve_replicas", **labels, state="healthy") == 1.0


class StartingFake(ElasticFake):
    """Placement at once; a new replica then loads (``starting``) until ``warm`` is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.warm = asyncio.Event()

    async def add_replica(self, pending_timeout_s: float) -> bool:
        self.states.append("starting")
        await self.warm.wait()
        self.states[self.states.index("starting")] = "healthy"
        return True


async def test_a_load_that_needs_several_replicas_places_them_one_after_another() -> None:
    gate = asyncio.Event()
    gate.set()
    runner = StartingFake(gate=gate)
    model = await served(elastic_settings(max_replicas=4, upscale_delay_s=1), runner)
    gate.clear()
    await model.stop_jobs(WAIT_S)
    batcher = model.require_batcher()
    requests = [await spawn(batcher.submit(make_rows(4, start=i * 4))) for i in range(4)]
    await runner.wait_started(3)
    scaler = Scaler(model, runner, batcher)
    # 2.5x what one replica answers: of 50 requests, 30 were refused (503, queue full).
    for status in [200] * 20 + [503] * 30:
        model.metrics.observe_latency(status, 0.01)
    scaler.tick(0.0)
    up = scaler.tick(1.0)
    assert (up.direction, up.target) == ("up", 3)
    assert "the offered load needs 2.5 replicas" in up.detail
    await until(lambda: runner.states == ["healthy", "starting"])
    # Placed, still loading: the next one is asked for at once, not after the first serves.
    scaler.tick(1.5)
    await until(lambda: runner.states == ["healthy", "starting", "starting"])
    scaler.tick(2.0)  # the target reached: nothing more
    await asyncio.sleep(0)
    assert len(runner.states) == 3
    runner.warm.set()
    await until(lambda: runner.states == ["healthy"] * 3 and not scaler.adds)
    text = model.server_metrics.render().decode()
    labels = {"model": "m", "version": "1"}
    assert metric(text, "shardserve_scale_events_total", **labels, direction="up") == 1.0
    gate.set()
    await asyncio.gather(*requests)


async def test_a_limit_the_operator_set_is_left_alone() -> None:
    runner = ElasticFake()
    model = await served(elastic_settings(max_queue_rows=40), runner)
    await model.stop_jobs(WAIT_S)
    batcher = model.require_batcher()
    scaler = Scaler(model, runner, batcher)  # as the loop makes it, at READY
    operator_sets(model, {"max_inflight_batches": 7})  # then an admin PUT
    runner.states.append("healthy")
    scaler.tick(0.0)
    assert (batcher.settings.max_inflight_batches, batcher.settings.max_queue_rows) == (7, 40)
    assert batcher.settings.pipeline_depth == 2  # the model's shape, not a choice


async def test_a_runner_that_cannot_change_its_count_is_never_scaled() -> None:
    runner = FakeRunner()
    assert not isinstance(runner, ElasticRunner)
    model = await served(elastic_settings(), runner)
    observe(model, 0.0)  # as the reconciler's tick samples a READY version
    assert scale_step(model) is None
    assert model.scaling_parameters() == {
        "min_replicas": 1,
        "max_replicas": 3,
        "target_replicas": 1,
        "reason": "fixed",
        "detail": "its runner cannot add or remove replicas",
        "pending": "",
    }
    await model.stop_jobs(WAIT_S)


async def test_a_new_version_starts_at_the_count_the_old_one_serves_with() -> None:
    state = ServerState(elastic_settings())
    runner = ElasticFake()
    runner.states = ["healthy", "healthy", "healthy", "draining"]
    old = ServedModel("m", elastic_settings(max_replicas=4), state.metrics, version="1")
    state.add_model(old)
    old.runner = runner
    put_in_state(old, "WARMING", "READY")
    # What the reconciler starts a new version with (``serving.elastic.count``).
    served = state.models["m"].values()
    assert inherited_settings(elastic_settings(max_replicas=2), served).replicas == 2  # 3 serve;
    # clamped to its own max_replicas
    assert inherited_settings(Settings(model="fake", replicas=1), served).replicas == 1


def test_a_private_ray_reserves_cpus_for_the_most_replicas() -> None:
    one = Settings(model="fake", stages=2)
    elastic = Settings(model="fake", stages=2, max_replicas=4)
    assert private_ray_cpus([elastic]) > private_ray_cpus([one])
    cpus = pipeline_options(elastic).cpus_per_shard
    assert cpus is not None and cpus >= 1  # each stage actor's share among 8, in threads
    assert pipeline_options(one).cpus_per_shard is None  # a fixed count: as before


class SplitFake(ElasticFake):
    """A split model's runner: stages "0.0", "0.1" (one layer's parts, side by side) and "1"."""

    num_stages = 3
    pipeline_depth = 2


async def test_a_split_models_limits_are_the_same_at_start_after_a_scale_step_and_where_shown() -> (
    None
):
    from serving.server.admin_routes import change_model, policy_changes
    from serving.server.app import _served

    runner = SplitFake()
    state = ServerState(elastic_settings())
    model = await served(elastic_settings(upscale_delay_s=60, downscale_delay_s=60), runner)
    state.add_model(model)
    stop_scaling(model)
    await model.stop_jobs(WAIT_S)
    batcher = model.require_batcher()
    start = batcher.settings
    # Two stages one after the other: 1 x (2 + 1) batches in flight, the parts counted once.
    assert (start.max_inflight_batches, start.pipeline_depth) == (3, 2)
    Scaler(model, runner, batcher).tick(0.0)  # the first observation, one healthy replica
    assert batcher.settings == start
    # The admin route's derived queue and the OpenAPI document's bound are the live queue's.
    same = change_model(model.settings)(max_batch_size=start.max_batch_size)
    operator_sets(model, policy_changes(same, batcher, model.settings))
    assert batcher.settings.max_queue_rows == start.max_queue_rows
    assert _served(state).max_rows == start.max_queue_rows
