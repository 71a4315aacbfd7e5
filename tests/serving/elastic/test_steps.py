"""The steps the reconciler takes for a version's count: ``observe`` keeps the decision on the
version, ``scale_step`` hands out the coroutine of one step once per observation (named for the
counter's label), none while the version is held (a hold given before READY included: it is the
version's, not the process's), and none for a count that never changes. The policy under it is a
pure function: the same observation and state give the same decision, and nothing is kept."""

from __future__ import annotations

import asyncio

from serving.elastic.policy import Observation, PolicyState, ScalePolicy, decide
from serving.elastic.steps import hold, observe, release, scale_state, scale_step
from serving.metrics.series import Metrics
from serving.settings.config import Settings
from serving.version.served import ServedModel
from tests.fakes import WAIT_S, FakeRunner, make_rows, spawn
from tests.serving.elastic.test_scaling_loop import ElasticFake, elastic_settings, served, until


def test_the_policy_is_a_function_of_what_it_is_given() -> None:
    policy = ScalePolicy(1, 3, target_queue_wait_ms=50, upscale_delay_s=5, downscale_delay_s=60)
    seen = Observation(80.0, 8, healthy=1, pending=0, replicas=1, replica_rows=4.0)
    start = PolicyState()
    first, state = decide(seen, start, policy, 0.0)
    assert first.direction == "" and state == PolicyState(0.0, None, 1)
    assert decide(seen, start, policy, 0.0) == (first, state)  # nothing kept between calls
    up, after = decide(seen, state, policy, 5.0)
    assert (up.direction, up.target, up.reason) == ("up", 2, "queue_wait")
    assert after == PolicyState(None, None, 1)  # both windows start again after a step


async def test_one_step_per_observation_and_none_while_held() -> None:
    gate = asyncio.Event()
    gate.set()  # the warm-up batch goes through
    runner = ElasticFake(gate=gate)
    model = ServedModel("m", elastic_settings(), Metrics())
    hold(model, "version 2 replaces version 1 replica by replica")  # before it loads

    async def factory(_: Settings) -> FakeRunner:
        return runner

    model.start(factory, None)
    await asyncio.wait_for(model.until_ready(), WAIT_S)
    gate.clear()
    await model.stop_jobs(WAIT_S)  # the test observes and steps itself
    batcher = model.require_batcher()
    requests = [await spawn(batcher.submit(make_rows(4, start=i * 4))) for i in range(4)]
    await runner.wait_started(3)  # a backlog that asks for a replica
    try:
        observe(model, 0.0)
        assert scale_step(model) is None
        assert model.scaling is not None and model.scaling.reason == "held"
        release(model)
        observe(model, 1.0)
        step = scale_step(model)
        assert step is not None and step.__name__ == "scale_up"
        assert scale_step(model) is None  # once per observation
        task = asyncio.ensure_future(step)
        await until(lambda: "pending" in runner.states)
        observe(model, 2.0)
        assert scale_step(model) is None  # one pending at a time
        runner.place.set()
        await task
        assert runner.states == ["healthy", "healthy"]
    finally:
        gate.set()
        await asyncio.gather(*requests)


async def test_a_fixed_count_has_no_steps() -> None:
    model = await served(Settings(model="fake", replicas=1), ElasticFake())
    await model.stop_jobs(WAIT_S)
    observe(model, 0.0)
    assert scale_step(model) is None
    assert scale_state(model).fixed and model.scaling is None
