"""A request's sequences handed out as their tokens come: each token as its step ends (a stop id
never), the text of several choices apart, coalesced while nobody reads."""

from __future__ import annotations

import asyncio

from serving.generation.scheduler import Scheduler, SchedulerSettings
from serving.generation.sequence import GenerationParams
from serving.generation.text_run import TextRun
from tests.generation_fakes import FakeGenerationReplica, expected_ids


class Digits:
    """A tokenizer whose id i is the text "<i>"."""

    max_token_bytes = 8

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.strip("<>").split("><")]

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


async def test_each_token_is_told_as_its_step_ends_and_a_stop_id_never() -> None:
    gate = asyncio.Event()
    fake = FakeGenerationReplica(gate=gate)
    scheduler = Scheduler([fake], SchedulerSettings(groups=1))
    scheduler.start()
    try:
        want = expected_ids([5], 6)
        told: list[int] = []
        params = GenerationParams(max_tokens=6, stop_ids=frozenset({want[3]}))
        call = asyncio.ensure_future(
            scheduler.generate([5], params, on_token=lambda t, _: told.append(t))
        )
        await fake.wait_started(1)
        assert told == []
        gate.set()
        done = await call
        assert told == want[:3] == list(done.output_ids)  # the stop id is not handed out
    finally:
        await scheduler.close()


async def test_choices_come_apart_and_coalesce_while_nobody_reads() -> None:
    fake = FakeGenerationReplica()
    scheduler = Scheduler([fake], SchedulerSettings(groups=1))
    scheduler.start()
    try:
        params = GenerationParams(max_tokens=4)
        run = TextRun(scheduler, [(3,), (4, 5)], params, Digits())
        run.start()
        await fake.wait_started(4)  # nobody reads while four steps run
        await asyncio.sleep(0)
        texts: dict[int, str] = {0: "", 1: ""}
        batches = 0
        while (deltas := await run.next()) is not None:
            batches += 1
            for delta in deltas:
                texts[delta.index] += delta.text
        assert texts == {
            0: Digits().decode(expected_ids([3], 4)),
            1: Digits().decode(expected_ids([4, 5], 4)),
        }
        assert batches < 4  # what came while nobody read came at once
        assert (run.prompt_tokens, run.completion_tokens) == (3, 8)
    finally:
        await scheduler.close()
