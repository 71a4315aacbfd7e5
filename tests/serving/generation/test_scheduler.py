"""The iteration-level scheduler on the fake replica: no Ray, no TensorFlow."""

from __future__ import annotations

import asyncio
import time

import pytest

from serving.errors import DeadlineExceededError, ModelInputError, QueueFullError
from serving.generation.scheduler import Scheduler, SchedulerSettings
from serving.generation.sequence import GenerationParams
from shards.generation.contract import Sampling
from tests.fakes import WAIT_S
from tests.generation_fakes import FakeGenerationReplica, expected_ids, make_info


class Observed:
    def __init__(self) -> None:
        self.steps: list[tuple[str, int]] = []
        self.first: list[float] = []
        self.gaps: list[float] = []
        self.tokens = 0

    def observe_step(self, kind: str, rows: int) -> None:
        self.steps.append((kind, rows))

    def observe_first_token(self, seconds: float, priority: str) -> None:
        self.first.append(seconds)

    def observe_queue_wait(self, seconds: float, priority: str) -> None:
        pass

    def observe_preemption(self, priority: str) -> None:
        pass

    def observe_refusal(self, priority: str) -> None:
        pass

    def observe_token_gap(self, seconds: float) -> None:
        self.gaps.append(seconds)

    def observe_tokens(self, count: int) -> None:
        self.tokens += count

    def observe_stream(self, outcome: str) -> None:
        raise AssertionError("the scheduler counts no stream: the streaming route does")


def params(max_tokens: int, **kw: object) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


async def started(
    replicas: list[FakeGenerationReplica], settings: SchedulerSettings | None = None
) -> Scheduler:
    scheduler = Scheduler(replicas, settings or SchedulerSettings(groups=1), Observed())
    scheduler.start()
    return scheduler


async def until(predicate: object) -> None:
    async def poll() -> None:
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0)

    await asyncio.wait_for(poll(), WAIT_S)


async def test_one_prompt_gets_its_ids_and_frees_its_slot() -> None:
    fake = FakeGenerationReplica()
    scheduler = await started([fake])
    done = await scheduler.generate([3, 4, 5], params(6))
    assert list(done.output_ids) == expected_ids([3, 4, 5], 6)
    assert (done.finish_reason, done.prompt_tokens) == ("length", 3)
    assert (scheduler.running, scheduler.free_slots) == (0, 4)
    # One prefill of the prompt, then one decode row per token at its own position.
    assert [(r.position, len(r.token_ids)) for s in fake.steps for r in s] == [
        (0, 3), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1)
    ]  # fmt: skip
    await scheduler.close()
    assert fake.closed


async def test_a_stop_id_ends_the_sequence_and_is_not_answered() -> None:
    scheduler = await started([FakeGenerationReplica()])
    want = expected_ids([7], 5)
    done = await scheduler.generate([7], params(5, stop_ids=frozenset({want[2]})))
    assert (list(done.output_ids), done.finish_reason) == (want[:2], "stop")
    await scheduler.close()


async def test_the_slot_length_ends_a_sequence() -> None:
    scheduler = await started([FakeGenerationReplica(make_info(max_length=6))])
    done = await scheduler.generate([1, 2, 3, 4], params(10))
    assert (len(done.output_ids), done.finish_reason) == (2, "length")
    await scheduler.close()


async def test_staggered_prompts_share_steps_at_their_own_positions() -> None:
    fake = FakeGenerationReplica()
    observed = Observed()
    scheduler = Scheduler([fake], SchedulerSettings(groups=1), observed)
    scheduler.start()
    first = asyncio.ensure_future(scheduler.generate([1, 2, 3, 4, 5], params(12)))
    await fake.wait_started(3)
    second = asyncio.ensure_future(scheduler.generate([9, 8], params(4)))
    a, b = await asyncio.gather(first, second)
    assert list(a.output_ids) == expected_ids([1, 2, 3, 4, 5], 12)
    assert list(b.output_ids) == expected_ids([9, 8], 4)
    shared = [s for s in fake.steps if len(s) > 1]
    assert shared, "no step held both sequences"
    # The second joined with its prefill beside the first's decode row, then decoded beside it.
    assert any(0 in {r.position for r in s} for s in shared)  # a prefill beside a decode
    assert any(min(r.position for r in s) > 0 and len({r.position for r in s}) == 2 for s in shared)
    assert max(rows for _, rows in observed.steps) == 2
    assert ("prefill", 2) in observed.steps and ("decode", 2) in observed.steps
    # The short answer left while the long one ran on: it did not wait for it.
    assert len(fake.steps[-1]) == 1
    assert observed.tokens == 16 and len(observed.first) == 2 and len(observed.gaps) == 14
    await scheduler.close()


async def test_a_fixed_prefill_timeout_starts_prompts_together_once_full() -> None:
    fake = FakeGenerationReplica(make_info(kv_slots=2))
    scheduler = await started([fake], SchedulerSettings(groups=1, prefill_timeout_ms=60_000))
    first = asyncio.ensure_future(scheduler.generate([1, 2], params(2)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert fake.started == 0  # waits for a second prompt (or the timeout)
    second = asyncio.ensure_future(scheduler.generate([3], params(2)))
    await asyncio.gather(first, second)
    assert [(r.position, r.token_ids) for r in fake.steps[0]] == [(0, (1, 2)), (0, (3,))]
    await scheduler.close()


async def test_a_fixed_prefill_timeout_starts_a_lone_prompt_when_it_runs_out() -> None:
    scheduler = await started(
        [FakeGenerationReplica(make_info(kv_slots=2))],
        SchedulerSettings(groups=1, prefill_timeout_ms=1),
    )
    done = await scheduler.generate([1, 2], params(2))
    assert list(done.output_ids) == expected_ids([1, 2], 2)
    await scheduler.close()


async def test_a_full_set_of_slots_queues_prompts_until_one_frees() -> None:
    fake = FakeGenerationReplica(make_info(kv_slots=1))
    scheduler = await started([fake])
    first = asyncio.ensure_future(scheduler.generate([1], params(5)))
    second = asyncio.ensure_future(scheduler.generate([2], params(3)))
    await fake.wait_started(2)
    assert (scheduler.running, scheduler.waiting, scheduler.free_slots) == (1, 1, 0)
    _, b = await asyncio.gather(first, second)
    assert list(b.output_ids) == expected_ids([2], 3)
    assert all(len(step) == 1 for step in fake.steps)
    assert (scheduler.running, scheduler.free_slots) == (0, 1)
    await scheduler.close()


async def test_max_running_sequences_holds_the_rest_back() -> None:
    fake = FakeGenerationReplica(make_info(kv_slots=4))
    scheduler = await started([fake], SchedulerSettings(groups=1, max_running_sequences=1))
    await asyncio.gather(*(scheduler.generate([i + 1], params(3)) for i in range(3)))
    assert all(len(step) == 1 for step in fake.steps)
    scheduler.knobs.change(max_running_sequences=3)
    await asyncio.gather(*(scheduler.generate([i + 1], params(3)) for i in range(3)))
    assert max(len(step) for step in fake.steps) == 3
    with pytest.raises(ValueError, match="from 1 to kv_slots=4, got 5"):
        scheduler.knobs.change(max_running_sequences=5)
    await scheduler.close()


async def test_a_full_queue_is_refused_with_retry_after() -> None:
    gate = asyncio.Event()
    fake = FakeGenerationReplica(make_info(kv_slots=1), gate)
    scheduler = await started([fake], SchedulerSettings(groups=1, max_waiting=1))
    running = asyncio.ensure_future(scheduler.generate([1], params(2)))
    await fake.wait_started(1)
    queued = asyncio.ensure_future(scheduler.generate([2], params(2)))
    await until(lambda: scheduler.waiting == 1)
    with pytest.raises(QueueFullError) as refused:
        await scheduler.generate([3], params(2))
    assert refused.value.retry_after_s == 1.0
    gate.set()
    await asyncio.gather(running, queued)
    await scheduler.close()


async def test_a_hang_up_frees_the_slot_within_one_step() -> None:
    gate = asyncio.Event()
    fake = FakeGenerationReplica(make_info(kv_slots=1), gate)
    scheduler = await started([fake])
    client = asyncio.ensure_future(scheduler.generate([1, 2], params(20)))
    await fake.wait_started(1)
    client.cancel()
    queued = asyncio.ensure_future(scheduler.generate([5], params(2)))
    gate.set()
    done = await asyncio.wait_for(queued, WAIT_S)
    assert list(done.output_ids) == expected_ids([5], 2)
    # The step in flight at the hang-up was the gone sequence's last: the next was the new one's.
    assert [[r.token_ids for r in s] for s in fake.steps] == [
        [(1, 2)],
        [(5,)],
        [done.output_ids[:1]],
    ]
    assert scheduler.free_slots == 1
    await scheduler.close()


async def test_a_queued_prompt_whose_client_left_never_starts() -> None:
    gate = asyncio.Event()
    fake = FakeGenerationReplica(make_info(kv_slots=1), gate)
    scheduler = await started([fake])
    running = asyncio.ensure_future(scheduler.generate([1], params(3)))
    await fake.wait_started(1)
    left = asyncio.ensure_future(scheduler.generate([42], params(3)))
    await until(lambda: scheduler.waiting == 1)
    left.cancel()
    await asyncio.sleep(0)
    assert scheduler.waiting == 0
    gate.set()
    await running
    assert all(42 not in r.token_ids for s in fake.steps for r in s)
    await scheduler.close()


async def test_a_deadline_is_a_504_and_frees_the_slot() -> None:
    gate = asyncio.Event()
    fake = FakeGenerationReplica(make_info(kv_slots=1), gate)
    scheduler = await started([fake])
    with pytest.raises(DeadlineExceededError, match="generation_timeout_ms"):
        await scheduler.generate([1], params(3), deadline=time.monotonic() + 0.01)
    gate.set()
    await until(lambda: scheduler.free_slots == 1)
    await scheduler.close()


async def test_a_lost_replica_prefills_again_and_answers_the_same_ids() -> None:
    fake = FakeGenerationReplica(make_info(kv_slots=2))
    scheduler = await started([fake])
    seeded = Sampling(temperature=0.7, seed=11)
    a = asyncio.ensure_future(scheduler.generate([4, 5, 6], params(10)))
    b = asyncio.ensure_future(scheduler.generate([8], params(10, sampling=seeded)))
    await fake.wait_started(4)
    fake.kill()
    await until(lambda: fake.refused == 1)  # the step in flight met the dead stage
    fake.revive()
    done_a, done_b = await asyncio.gather(a, b)
    assert list(done_a.output_ids) == expected_ids([4, 5, 6], 10)
    assert list(done_b.output_ids) == expected_ids([8], 10, seed=11)
    # Prefilled again from the prompt and what each had generated so far.
    refills = [r for s in fake.steps for r in s if r.position == 0 and r.token_index > 0]
    assert len(refills) == 2
    for row in refills:
        prompt = [4, 5, 6] if row.token_ids[0] == 4 else [8]
        seed = None if prompt == [4, 5, 6] else 11
        want = prompt + expected_ids(prompt, row.token_index, seed)
        assert list(row.token_ids) == want
    await scheduler.close()


async def test_a_failed_step_fails_its_row_alone() -> None:
    fake = FakeGenerationReplica(make_info(kv_slots=2))
    fake.poison_id = 13
    scheduler = await started([fake], SchedulerSettings(groups=1, prefill_timeout_ms=60_000))
    good = asyncio.ensure_future(scheduler.generate([1, 2], params(4)))
    bad = asyncio.ensure_future(scheduler.generate([13], params(4)))
    with pytest.raises(ModelInputError, match="the poison id"):
        await bad
    assert list((await good).output_ids) == expected_ids([1, 2], 4)
    assert fake.steps[0][0].token_ids == (1, 2)  # the good row ran its prefill once more
    await scheduler.close()


async def test_k_groups_are_in_flight_at_once() -> None:
    gate = asyncio.Event()
    fake = FakeGenerationReplica(make_info(kv_slots=6, stages=2), gate)
    scheduler = await started([fake], SchedulerSettings())  # groups: stages + 1
    prompts = [[i + 1] * (i + 1) for i in range(6)]
    calls = [asyncio.ensure_future(scheduler.generate(p, params(3))) for p in prompts]
    await fake.wait_started(3)
    assert fake.inflight == 3
    gate.set()
    results = await asyncio.gather(*calls)
    assert [list(r.output_ids) for r in results] == [expected_ids(p, 3) for p in prompts]
    # Each group of 2 sequences: a step's rows hold distinct slots, every step 2 rows.
    assert {len(s) for s in fake.steps} == {2}
    await scheduler.close()


async def test_a_prompt_goes_to_a_replica_with_a_free_slot() -> None:
    gate = asyncio.Event()
    one = FakeGenerationReplica(make_info(kv_slots=1), gate)
    two = FakeGenerationReplica(make_info(kv_slots=1), gate)
    scheduler = await started([one, two])
    calls = [asyncio.ensure_future(scheduler.generate([i + 1], params(2))) for i in range(2)]
    await one.wait_started(1)
    await two.wait_started(1)
    gate.set()
    results = await asyncio.gather(*calls)
    assert [list(r.output_ids) for r in results] == [expected_ids([i + 1], 2) for i in range(2)]
    await scheduler.close()


async def test_close_fails_what_is_left_and_refuses_new_prompts() -> None:
    gate = asyncio.Event()
    fake = FakeGenerationReplica(make_info(kv_slots=1), gate)
    scheduler = await started([fake])
    running = asyncio.ensure_future(scheduler.generate([1], params(3)))
    queued = asyncio.ensure_future(scheduler.generate([2], params(3)))
    await fake.wait_started(1)
    await scheduler.close("the version retired")
    for call in (running, queued):
        with pytest.raises(Exception, match="the version retired") as failed:
            await call
        assert failed.value.status_code == 503  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="the version retired"):
        await scheduler.generate([3], params(1))


def test_the_server_settings_choose_the_groups_and_the_prefill_wait() -> None:
    from serving.generation.engine import scheduler_settings
    from serving.settings.config import Settings

    auto = scheduler_settings(Settings(model="m", kv_slots=4))
    assert (auto.prefill_timeout_ms, auto.groups, auto.max_running_sequences) == (None, None, None)
    fixed = scheduler_settings(
        Settings(
            model="m",
            prefill_timeout_ms=7,
            generation_groups=1,
            kv_slots=4,
            max_running_sequences=2,
            max_waiting_prompts=3,
        )
    )
    assert (fixed.prefill_timeout_ms, fixed.groups, fixed.max_running_sequences) == (7.0, 1, 2)
    assert fixed.max_waiting == 3
