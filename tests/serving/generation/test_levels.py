"""Priority levels on the fake replica (issue 41): the queue by level, preemption that loses no
token, the deadline error of a preempted sequence, admission per level. No Ray, no TensorFlow."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import numpy as np
import pytest

from serving.errors import DeadlineExceededError, InvalidInputError, QueueFullError
from serving.generation.levels import Levels
from serving.generation.scheduler import Scheduler, SchedulerSettings
from serving.generation.sequence import GenerationParams
from shards.generation.contract import Sampling
from shards.generation.sampling import sample_rows
from tests.fakes import WAIT_S
from tests.generation_fakes import FakeGenerationReplica, expected_ids, make_info

RNG = np.random.default_rng(0)


class ByLevel:
    """What the scheduler tells the metrics, by level."""

    def __init__(self) -> None:
        self.first: Counter[str] = Counter()
        self.waits: Counter[str] = Counter()
        self.preemptions: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()

    def observe_step(self, kind: str, rows: int) -> None:
        pass

    def observe_first_token(self, seconds: float, priority: str) -> None:
        self.first[priority] += 1

    def observe_queue_wait(self, seconds: float, priority: str) -> None:
        self.waits[priority] += 1

    def observe_preemption(self, priority: str) -> None:
        self.preemptions[priority] += 1

    def observe_refusal(self, priority: str) -> None:
        self.refusals[priority] += 1

    def observe_token_gap(self, seconds: float) -> None:
        pass

    def observe_tokens(self, count: int) -> None:
        pass

    def observe_stream(self, outcome: str) -> None:
        pass


def params(max_tokens: int, **kw: object) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


async def started(fake: FakeGenerationReplica, **settings: object) -> tuple[Scheduler, ByLevel]:
    observed = ByLevel()
    chosen = SchedulerSettings(**{"groups": 1, **settings})  # type: ignore[arg-type]
    scheduler = Scheduler([fake], chosen, observed)
    scheduler.start()
    return scheduler, observed


async def until(predicate: object) -> None:
    async def poll() -> None:
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0)

    await asyncio.wait_for(poll(), WAIT_S)


def prefills(fake: FakeGenerationReplica) -> list[tuple[int, ...]]:
    """The prompts of the prefill rows, in the order their steps ran."""
    return [r.token_ids for s in fake.steps for r in s if r.position == 0]


async def test_a_high_prompt_starts_before_16_queued_low_ones() -> None:
    gate = asyncio.Event()
    fake = FakeGenerationReplica(make_info(kv_slots=1), gate)
    scheduler, observed = await started(fake, max_preemptions=0)
    running = asyncio.ensure_future(scheduler.generate([1], params(3)))
    await fake.wait_started(1)
    lows = [asyncio.ensure_future(scheduler.generate([2, i], params(2))) for i in range(16)]
    await until(lambda: scheduler.waiting == 16)
    high = asyncio.ensure_future(scheduler.generate([3], params(2), priority="high"))
    await until(lambda: scheduler.waiting == 17)
    gate.set()
    done = await asyncio.gather(running, high, *lows)
    order = prefills(fake)
    assert order[:2] == [(1,), (3,)]  # the one running, then the high one; then the lows in turn
    assert order[2:] == [(2, i) for i in range(16)]
    assert list(done[1].output_ids) == expected_ids([3], 2)
    assert observed.first == {"low": 17, "high": 1}
    assert observed.waits == {"low": 17, "high": 1}
    assert not observed.preemptions
    await scheduler.close()


async def test_a_high_prompt_preempts_a_low_sequence_which_loses_no_token() -> None:
    fake = FakeGenerationReplica(make_info(kv_slots=2, max_length=64))
    scheduler, observed = await started(fake)
    seeded = Sampling(temperature=0.8, seed=5)
    low_a = asyncio.ensure_future(scheduler.generate([4, 5], params(40)))
    low_b = asyncio.ensure_future(scheduler.generate([6], params(40, sampling=seeded)))
    await fake.wait_started(3)  # both are decoding: every slot is taken
    high = await scheduler.generate([7], params(5), priority="high")
    done_a, done_b = await asyncio.gather(low_a, low_b)
    assert list(high.output_ids) == expected_ids([7], 5)
    assert list(done_a.output_ids) == expected_ids([4, 5], 40)
    assert list(done_b.output_ids) == expected_ids([6], 40, seed=5)
    assert observed.preemptions == {"low": 1}
    # The victim was prefilled again from its prompt and what it had generated, at the head of
    # its level: its draws keyed as before.
    refills = [r for s in fake.steps for r in s if r.position == 0 and r.token_index > 0]
    assert len(refills) == 1
    row = refills[0]
    prompt, seed = ([6], 5) if row.token_ids[0] == 6 else ([4, 5], None)
    assert list(row.token_ids) == prompt + expected_ids(prompt, row.token_index, seed)
    assert scheduler.free_slots == 2
    await scheduler.close()


async def test_an_unseeded_sampled_sequence_keeps_its_draws_across_a_preemption() -> None:
    fake = FakeGenerationReplica(make_info(kv_slots=1, max_length=64))
    scheduler, _ = await started(fake)
    low = asyncio.ensure_future(
        scheduler.generate([9], params(30, sampling=Sampling(temperature=1.0)))
    )
    await fake.wait_started(2)
    await scheduler.generate([7], params(3), priority="high")
    done = await low
    keys = {r.sampling.draw_key for s in fake.steps for r in s if r.sampling.temperature == 1.0}
    assert len(keys) == 1 and None not in keys  # one key, drawn at its arrival
    assert list(done.output_ids) == expected_ids([9], 30)
    # The real sampler keys an unseeded row's draws by it as a seeded row's by its seed.
    logits = np.linspace(0.0, 1.0, 40)
    key = keys.pop()
    unseeded = Sampling(temperature=1.0, draw_key=key)
    drawn = [sample_rows(logits[None], [unseeded], [t], RNG)[0][0] for t in range(8)]
    seeded = [
        sample_rows(logits[None], [Sampling(1.0, seed=key)], [t], RNG)[0][0] for t in range(8)
    ]
    assert drawn == seeded
    await scheduler.close()


async def test_a_sequence_is_preempted_at_most_max_preemptions_times() -> None:
    fake = FakeGenerationReplica(make_info(kv_slots=1, max_length=64))
    scheduler, observed = await started(fake, max_preemptions=1)
    low = asyncio.ensure_future(scheduler.generate([9], params(40)))
    await fake.wait_started(2)
    await scheduler.generate([7], params(2), priority="high")
    await until(lambda: scheduler.running == 1 and scheduler.waiting == 0)  # the low is back
    second = asyncio.ensure_future(scheduler.generate([8], params(2), priority="high"))
    done, _ = await asyncio.gather(low, second)
    assert list(done.output_ids) == expected_ids([9], 40)
    assert prefills(fake)[-1] == (8,)  # the low one ran to its end first
    assert observed.preemptions == {"low": 1}
    await scheduler.close()


async def test_a_preempted_low_request_past_its_deadline_says_it_was_preempted() -> None:
    gate = asyncio.Event()
    gate.set()
    fake = FakeGenerationReplica(make_info(kv_slots=1, max_length=64), gate)
    scheduler, _ = await started(fake)
    low = asyncio.ensure_future(
        scheduler.generate([9], params(40), deadline=time.monotonic() + 2.0)
    )
    await fake.wait_started(2)
    high = asyncio.ensure_future(scheduler.generate([7], params(40), priority="high"))
    await until(lambda: scheduler.waiting == 1 and scheduler.running == 1)  # the low waits
    gate.clear()  # the high one holds the slot until the low one's deadline
    with pytest.raises(DeadlineExceededError, match="preempted 1 time"):
        await low
    assert scheduler.waiting == 0
    gate.set()
    await high
    await scheduler.close()


async def test_a_flood_of_low_prompts_does_not_refuse_a_high_one() -> None:
    gate = asyncio.Event()
    fake = FakeGenerationReplica(make_info(kv_slots=1), gate)
    scheduler, observed = await started(fake, max_waiting=2, max_preemptions=0)
    running = asyncio.ensure_future(scheduler.generate([1], params(2)))
    await fake.wait_started(1)
    lows = [asyncio.ensure_future(scheduler.generate([2], params(2))) for _ in range(2)]
    await until(lambda: scheduler.waiting == 2)
    with pytest.raises(QueueFullError, match="priority low"):
        await scheduler.generate([3], params(2))
    with pytest.raises(QueueFullError, match="priority low"):
        scheduler.check_headroom("low")
    scheduler.check_headroom("high")  # the high level's own queue has room
    scheduler.check_headroom()  # and so not every level is full
    high = asyncio.ensure_future(scheduler.generate([4], params(2), priority="high"))
    await until(lambda: scheduler.waiting == 3)
    gate.set()
    done = await asyncio.gather(running, high, *lows)
    assert list(done[1].output_ids) == expected_ids([4], 2)
    assert observed.refusals == {"low": 2}
    await scheduler.close()


def test_levels_resolve_the_field_then_the_header_then_the_default() -> None:
    levels = Levels(("urgent", "high", "low"), "low")
    assert levels.resolve(None) == "low"
    assert levels.resolve(None, " urgent") == "urgent"
    assert levels.resolve("high", "urgent") == "high"
    assert levels.rank("urgent") == 0
    with pytest.raises(InvalidInputError, match=r"priority is 'top'.*urgent, high, low"):
        levels.resolve("top")
    with pytest.raises(InvalidInputError, match="header X-Priority is 'top'"):
        levels.resolve(None, "top")
    with pytest.raises(InvalidInputError, match="priority is 1"):
        levels.resolve(1)
    with pytest.raises(ValueError, match="not among the levels"):
        Levels(("high", "low"), "mid")
