"""A fake ``GenerationReplica`` (``shards.generation.contract``) for tests with neither Ray nor
TensorFlow.

It keeps a real per-slot cache of token ids and checks what a real stage would rely on: a prefill
at position 0, a decode row's one token at exactly the slot's next position. The next id is a
function of the slot's whole sequence so far (``next_id``): a sequence whose cache were wrong, or
re-prefilled from the wrong tokens, would answer other ids. A seeded row mixes in (seed, token
index), as the real sampler's draw is keyed.

Tests wait on events, never on sleeps: ``gate`` (when given) holds every step until set;
``started`` counts the steps begun; ``inflight_peak`` is the most steps in flight at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from shards.generation.contract import (
    GenerationInfo,
    ReplicaLost,
    RowResult,
    RowStep,
    StepFailed,
)

VOCAB = 50
END_ID = 0


def make_info(
    *,
    kv_slots: int = 4,
    max_length: int = 32,
    stages: int = 1,
    tokenizer_dir: str | None = None,
    vocabulary_size: int = VOCAB,
) -> GenerationInfo:
    return GenerationInfo(
        model_family="gpt2",
        vocabulary_size=vocabulary_size,
        max_length=max_length,
        kv_slots=kv_slots,
        stages=stages,
        end_token_ids=(END_ID,),
        start_token_id=END_ID if tokenizer_dir is not None else None,
        tokenizer_dir=tokenizer_dir,
        tokenizer_kind="byte_bpe" if tokenizer_dir is not None else None,
    )


def next_id(tokens: Sequence[int], seed: int | None = None, index: int = 0) -> int:
    """The id the fake samples after ``tokens`` (never the end id unless the sum says so)."""
    value = sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + 7
    if seed is not None:
        value += seed * 1009 + index * 17
    return 1 + value % (VOCAB - 1)


def expected_ids(prompt: Sequence[int], max_tokens: int, seed: int | None = None) -> list[int]:
    """What a sequence alone generates on the fake (no stop id met: ids are never 0)."""
    tokens, out = list(prompt), []
    for index in range(max_tokens):
        token = next_id(tokens, seed, index)
        out.append(token)
        tokens.append(token)
    return out


class FakeGenerationReplica:
    def __init__(self, info: GenerationInfo | None = None, gate: asyncio.Event | None = None):
        self.info = info or make_info()
        self.gate = gate
        self.cache: dict[int, list[int]] = {}
        self.steps: list[list[RowStep]] = []
        self.started = 0
        self.inflight = 0
        self.inflight_peak = 0
        # A step holding a row whose slot's sequence contains this id raises StepFailed for it.
        self.poison_id: int | None = None
        self.lost = False  # steps raise ReplicaLost until wait_ready()
        self.refused = 0  # steps that raised ReplicaLost
        self.ready = asyncio.Event()
        self.ready.set()
        self.closed = False
        self._started_event = asyncio.Event()

    async def wait_started(self, count: int) -> None:
        while self.started < count:
            self._started_event.clear()
            await self._started_event.wait()

    def kill(self) -> None:
        """The replica's stages die: every cache is gone; steps raise until it is back."""
        self.lost = True
        self.ready.clear()
        self.cache.clear()

    def revive(self) -> None:
        self.lost = False
        self.ready.set()

    async def step(self, rows: Sequence[RowStep]) -> list[RowResult]:
        self.started += 1
        self._started_event.set()
        self.inflight += 1
        self.inflight_peak = max(self.inflight_peak, self.inflight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(0)
            if self.lost:
                self.refused += 1
                raise ReplicaLost("a stage died")
            self.steps.append(list(rows))
            bad = [
                r.slot for r in rows if self.poison_id is not None and self.poison_id in r.token_ids
            ]
            if bad:
                raise StepFailed("the poison id", bad)
            out = []
            for row in rows:
                if row.position == 0:
                    self.cache[row.slot] = list(row.token_ids)
                else:
                    cached = self.cache.get(row.slot, [])
                    assert len(row.token_ids) == 1, row
                    assert row.position == len(cached), (row, len(cached))
                    cached.append(row.token_ids[0])
                tokens = self.cache[row.slot]
                assert len(tokens) <= self.info.max_length, row
                token = next_id(tokens, row.sampling.seed, row.token_index)
                out.append(RowResult(row.slot, token, -0.5))
            return out
        finally:
            self.inflight -= 1

    async def wait_ready(self) -> None:
        await self.ready.wait()

    async def close(self) -> None:
        self.closed = True
