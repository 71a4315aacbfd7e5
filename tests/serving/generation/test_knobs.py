"""The run-time knobs of a generating version (issue 41, item 3): their one owner's checks, and
each knob changed while the scheduler runs taking effect at its next step (the fake replica,
stepped one step at a time)."""

from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path

import pytest

from serving.generation.knobs import GenerationKnobs, within_budget
from serving.generation.scheduler import Scheduler, SchedulerSettings
from serving.generation.sequence import GenerationParams
from tests.fakes import WAIT_S
from tests.generation_fakes import FakeGenerationReplica, expected_ids, make_info


class Steps:
    """A gate for the fake replica that lets one step through per ``allow()``; ``open()``: all."""

    def __init__(self) -> None:
        self._permits = asyncio.Semaphore(0)
        self._open = False

    async def wait(self) -> None:
        if not self._open:
            await self._permits.acquire()

    def allow(self) -> None:
        self._permits.release()

    def open(self) -> None:
        self._open = True
        for _ in range(64):
            self._permits.release()


def stepped(kv_slots: int = 4) -> tuple[FakeGenerationReplica, Steps]:
    gate = Steps()
    return FakeGenerationReplica(make_info(kv_slots=kv_slots), gate), gate  # type: ignore[arg-type]


async def next_step(fake: FakeGenerationReplica, gate: Steps) -> list[tuple[int, ...]]:
    """Let the step in flight finish and return its rows' tokens (a prefill: the prompt)."""
    done = len(fake.steps)
    gate.allow()

    async def finished() -> None:
        while len(fake.steps) == done:
            await asyncio.sleep(0)

    await asyncio.wait_for(finished(), WAIT_S)
    return [r.token_ids for r in fake.steps[-1]]


def params(max_tokens: int) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens)


# ---- the owner's checks


def test_the_knobs_start_from_the_settings_and_default_to_every_slot() -> None:
    knobs = GenerationKnobs(4)
    assert (knobs.max_running_sequences, knobs.prefill_timeout_ms) == (4, None)
    assert knobs.prefill_budget_tokens is None
    knobs = GenerationKnobs(
        4, max_running_sequences=2, prefill_timeout_ms=5.0, prefill_budget_tokens=64
    )
    assert (knobs.max_running_sequences, knobs.prefill_timeout_ms) == (2, 5.0)
    assert knobs.prefill_budget_tokens == 64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_running_sequences": 5}, "from 1 to kv_slots=4, got 5; a running sequence holds"),
        ({"max_running_sequences": 0}, "from 1 to kv_slots=4, got 0"),
        ({"max_running_sequences": True}, "from 1 to kv_slots=4, got True"),
        ({"max_running_sequences": None}, "from 1 to kv_slots=4, got None"),
        ({"prefill_timeout_ms": -1}, "from 0 to 60000, or 'auto' (or null), got -1"),
        ({"prefill_timeout_ms": float("inf")}, "from 0 to 60000"),
        ({"prefill_timeout_ms": "soon"}, "got 'soon'"),
        ({"prefill_budget_tokens": 0}, "prefill_budget_tokens must be an integer from 1 to"),
        ({"prefill_budget_tokens": 2.5}, "or null for no cap, got 2.5"),
        ({"slots": 3}, "unknown knob 'slots'"),
    ],
)
def test_a_value_out_of_bounds_is_refused_by_name_and_changes_nothing(
    change: dict[str, object], message: str
) -> None:
    knobs = GenerationKnobs(4, max_running_sequences=3, prefill_budget_tokens=8)
    with pytest.raises(ValueError, match=re.escape(message)):
        knobs.change(**{"prefill_budget_tokens": 16, **change})
    assert (knobs.max_running_sequences, knobs.prefill_budget_tokens) == (3, 8)


def test_auto_and_null_are_the_adaptive_wait_and_no_cap() -> None:
    knobs = GenerationKnobs(4, prefill_timeout_ms=10.0, prefill_budget_tokens=8)
    heard: list[int] = []
    knobs.on_change(lambda: heard.append(1))
    knobs.change(prefill_timeout_ms="auto", prefill_budget_tokens=None)
    assert (knobs.prefill_timeout_ms, knobs.prefill_budget_tokens, heard) == (None, None, [1])
    assert knobs.prefill_wait.wait_s(waited_s=0, waiting=1, room=4, busy=False) == 0.0
    knobs.change(prefill_timeout_ms=10)
    assert knobs.prefill_wait.wait_s(waited_s=0, waiting=1, room=4, busy=False) == 0.01


@pytest.mark.parametrize(
    ("lengths", "budget", "room", "taken"),
    [
        ([3, 3, 3], None, 2, 2),  # no cap: the room
        ([3, 3, 3], 6, 4, 2),  # what fits
        ([3, 3, 3], 5, 4, 1),
        ([9, 1, 1], 4, 4, 1),  # a prompt past the budget goes alone: never starved
        ([1, 9, 1], 4, 4, 1),  # in order: no prompt jumps one that does not fit
        ([2, 2], 4, 1, 1),  # the room still holds
        ([], 4, 3, 0),
    ],
)
def test_within_budget(lengths: list[int], budget: int | None, room: int, taken: int) -> None:
    assert within_budget(lengths, budget, room) == taken


# ---- each knob changed at run time takes effect on the next step


async def test_max_running_sequences_changed_mid_run_admits_at_the_next_step() -> None:
    fake, gate = stepped(kv_slots=4)
    scheduler = Scheduler([fake], SchedulerSettings(groups=1, max_running_sequences=1))
    calls = [asyncio.ensure_future(scheduler.generate([i + 1], params(4))) for i in range(3)]
    await asyncio.sleep(0)
    scheduler.start()
    assert await next_step(fake, gate) == [(1,)]  # one at a time
    scheduler.knobs.change(max_running_sequences=3)
    assert len(await next_step(fake, gate)) == 1  # the step in flight keeps its rows
    rows = await next_step(fake, gate)
    assert rows[1:] == [(2,), (3,)]  # the next one took the other two
    scheduler.knobs.change(max_running_sequences=1)  # lowering it stops none that runs
    gate.open()
    answers = await asyncio.gather(*calls)
    assert [list(a.output_ids) for a in answers] == [expected_ids([i + 1], 4) for i in range(3)]
    await scheduler.close()


async def test_the_prefill_budget_changed_mid_run_caps_the_next_step() -> None:
    fake, gate = stepped(kv_slots=8)
    scheduler = Scheduler([fake], SchedulerSettings(groups=1, prefill_budget_tokens=3))
    prompts = [(1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12), (13, 14, 15, 16, 17, 18, 19)]
    calls = [asyncio.ensure_future(scheduler.generate(p, params(8))) for p in prompts]
    await asyncio.sleep(0)
    scheduler.start()
    assert await next_step(fake, gate) == [prompts[0]]  # 3 tokens of prompt per step
    scheduler.knobs.change(prefill_budget_tokens=6)
    assert (await next_step(fake, gate))[1:] == [prompts[1]]  # the step in flight, as it was
    # 6 now: two prompts join beside the decode rows; then 7 tokens, past the budget, alone.
    assert (await next_step(fake, gate))[2:] == [prompts[2], prompts[3]]
    assert (await next_step(fake, gate))[4:] == [prompts[4]]
    scheduler.knobs.change(prefill_budget_tokens=None)
    gate.open()
    answers = await asyncio.gather(*calls)
    assert [list(a.output_ids) for a in answers] == [expected_ids(p, 8) for p in prompts]
    await scheduler.close()


async def test_the_prefill_timeout_changed_mid_run_applies_at_the_next_step() -> None:
    fake, gate = stepped(kv_slots=4)
    scheduler = Scheduler([fake], SchedulerSettings(groups=1, prefill_timeout_ms=60_000))
    scheduler.start()
    first = asyncio.ensure_future(scheduler.generate([1, 2], params(8)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert fake.started == 0  # a lone prompt waits up to a minute for company
    scheduler.knobs.change(prefill_timeout_ms="auto")  # wakes the group: it starts now
    assert await next_step(fake, gate) == [(1, 2)]
    scheduler.knobs.change(prefill_timeout_ms=60_000)
    second = asyncio.ensure_future(scheduler.generate([3], params(2)))
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(await next_step(fake, gate)) == 1  # the step in flight
    assert len(await next_step(fake, gate)) == 1  # the new prompt waits for company
    scheduler.knobs.change(prefill_timeout_ms=0)
    assert len(await next_step(fake, gate)) == 1  # the step in flight
    assert (await next_step(fake, gate))[1:] == [(3,)]  # and it joins the next
    gate.open()
    a, b = await asyncio.gather(first, second)
    assert (list(a.output_ids), list(b.output_ids)) == (
        expected_ids([1, 2], 8),
        expected_ids([3], 2),
    )
    await scheduler.close()


def test_the_knobs_have_one_writer() -> None:
    """Only the admin route changes the knobs at run time (the scheduler reads them; the knobs
    set their start values themselves): a new writer fails here."""
    root = Path(__file__).resolve().parents[3]
    callers = set()
    for path in sorted((root / "serving").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if call and node.func.attr == "change":  # type: ignore[union-attr]
                callers.add(path.relative_to(root).as_posix())
    assert callers == {"serving/generation/knobs.py", "serving/server/admin_routes.py"}
