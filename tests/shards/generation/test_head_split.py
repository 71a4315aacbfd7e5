"""A tiny GPT-2 generating with its LM head split by vocabulary rows into 2 part actors (issue 42
item 5), on real Ray actors: greedy ids equal to keras_hub's ``generate`` (the fixture's expected
ids), seeded top-p and top-k draws equal to the unsplit head's (the whole stage in this process),
only the parts' summaries crossing, and a killed part recovered."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import ray

from shards.errors import PlanError
from shards.generation import ReplicaLost, RowStep, Sampling
from shards.generation.head_merge import slice_bounds
from shards.generation.partition import cut_blocks, head_part_params, stage_params
from shards.generation.preset import read_preset
from shards.generation.replica import Replica, start_generation_replicas
from shards.generation.sampling import sample_rows
from shards.generation.sizing import replica_asks
from tests.generation_models import TOTAL_LENGTH, Greedy

pytestmark = pytest.mark.asyncio(loop_scope="module")
SLOTS = 4
LENGTH = 32


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def split(
    ray_address: str, gpt2_greedy: Greedy, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Replica]:
    (replica,) = await start_generation_replicas(
        str(gpt2_greedy.preset),
        stages=2,
        kv_slots=SLOTS,
        max_sequence_length=LENGTH,
        num_cpus_per_stage=0.5,  # 2 stages + 2 head parts: 2 of the session's 4 CPUs
        ready_timeout_s=120.0,
        stage_cache_dir=str(tmp_path_factory.mktemp("head-split-files")),
        head_parts=2,
    )
    try:
        yield replica
    finally:
        await replica.close()


@dataclass
class _Seq:
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prefilled: bool = False

    def row(self, slot: int) -> RowStep:
        if not self.prefilled:
            return RowStep(
                slot, self.prompt + tuple(self.generated), 0, self.sampling, len(self.generated)
            )
        position = len(self.prompt) + len(self.generated) - 1
        return RowStep(slot, (self.generated[-1],), position, self.sampling, len(self.generated))


async def _run(replica: Replica, seqs: Sequence[_Seq], kill_head_at: int | None = None) -> int:
    """Every sequence in one group, one slot each, to its max_tokens; how many times the replica
    was lost (each time: wait, then prefill again from the tokens so far)."""
    lost = 0
    tick = 0
    while any(len(s.generated) < s.max_tokens for s in seqs):
        running = [(i, s) for i, s in enumerate(seqs) if len(s.generated) < s.max_tokens]
        if tick == kill_head_at:
            ray.kill(replica._heads[1], no_restart=False)
        tick += 1
        try:
            results = await replica.step([s.row(i) for i, s in running])
        except ReplicaLost:
            lost += 1
            await replica.wait_ready()
            for s in seqs:
                s.prefilled = False
            continue
        for (i, s), r in zip(running, results, strict=True):
            assert r.slot == i
            s.generated.append(r.token_id)
            s.logprobs.append(r.logprob)
            s.prefilled = True
    return lost


@functools.cache
def _whole_model(preset: Path) -> Any:
    from shards.generation.stage import StageModel

    spec = read_preset(str(preset))
    return StageModel(spec, 0, spec.num_layers, 1, LENGTH)


def _unsplit(greedy: Greedy, seq: _Seq) -> tuple[list[int], list[float]]:
    """The same sequence on the whole model with its head whole (this process, the unsplit
    stage and sampler; its slot is written over from position 0 each time)."""
    model = _whole_model(greedy.preset)
    rng = np.random.default_rng(0)
    ids: list[int] = []
    logprobs: list[float] = []
    x = np.array([seq.prompt], np.int32)
    position = 0
    while len(ids) < seq.max_tokens:
        one = np.zeros((1,), np.int32)
        logits = model.run(x, one, one + position, one + x.shape[1], LENGTH)
        token, logprob = sample_rows(logits, [seq.sampling], [len(ids)], rng)
        ids.append(int(token[0]))
        logprobs.append(float(logprob[0]))
        position += x.shape[1]
        x = np.array([[ids[-1]]], np.int32)
    return ids, logprobs


async def test_greedy_ids_equal_generate_with_the_head_in_two_parts(
    split: Replica, gpt2_greedy: Greedy
) -> None:
    assert split.info.head_parts == 2 and len(split._heads) == 2
    spec = read_preset(str(gpt2_greedy.preset))
    held = await asyncio.gather(*(a.describe.remote() for a in split._actors))
    last = cut_blocks(spec.num_layers, 2)[1]
    # The last stage holds no vocabulary: the head is in its parts, a slice each.
    assert held[1]["params"] == stage_params(spec, last, spec.num_layers, head=False)
    parts = await asyncio.gather(*(h.describe.remote() for h in split._heads))
    bounds = slice_bounds(spec.vocabulary_size, 2)
    assert [(p["offset"], p["offset"] + p["size"]) for p in parts] == bounds
    assert [p["params"] for p in parts] == head_part_params(spec, 2)
    seqs = [_Seq(p, TOTAL_LENGTH - len(p)) for p in gpt2_greedy.prompts[:SLOTS]]
    assert await _run(split, seqs) == 0
    for s, expected in zip(seqs, gpt2_greedy.generated[: len(seqs)], strict=True):
        assert tuple(s.generated) == expected
    assert split.rows_asked_again == 0


@pytest.mark.parametrize(
    ("sampling", "candidates"),
    [
        (Sampling(temperature=1.0, top_p=0.9, seed=7), 64),
        # Two first candidates a part: the nucleus runs past them, the parts are asked again.
        (Sampling(temperature=1.0, top_p=0.9, seed=7), 2),
        (Sampling(temperature=1.5, top_k=40, top_p=0.95, seed=11), 64),
    ],
)
async def test_seeded_draws_equal_the_unsplit_head(
    split: Replica,
    gpt2_greedy: Greedy,
    monkeypatch: pytest.MonkeyPatch,
    sampling: Sampling,
    candidates: int,
) -> None:
    monkeypatch.setattr(split, "_candidates", candidates)
    asked = split.rows_asked_again
    seq = _Seq(gpt2_greedy.prompts[0], 8, sampling)
    await _run(split, [seq])
    expected_ids, expected_logprobs = _unsplit(gpt2_greedy, seq)
    assert seq.generated == expected_ids
    np.testing.assert_allclose(seq.logprobs, expected_logprobs, atol=1e-5, rtol=0)
    assert tuple(seq.generated) != gpt2_greedy.generated[0][:8]  # sampled, not greedy
    if candidates == 2:
        assert split.rows_asked_again > asked


async def test_a_killed_head_part_is_lost_then_prefilled_again_to_the_same_tokens(
    split: Replica, gpt2_greedy: Greedy
) -> None:
    seqs = [_Seq(p, 10) for p in gpt2_greedy.prompts[:2]]
    assert await _run(split, seqs, kill_head_at=4) == 1
    for s, expected in zip(seqs, gpt2_greedy.generated[: len(seqs)], strict=True):
        assert tuple(s.generated) == expected[:10]


async def test_each_actor_asks_ray_for_its_own_plan_and_is_given_its_cap(
    split: Replica, gpt2_greedy: Greedy
) -> None:
    spec = read_preset(str(gpt2_greedy.preset))
    asks = replica_asks(spec, 2, SLOTS, LENGTH, 2, cpus=0.5)
    held = await asyncio.gather(*(a.describe.remote() for a in [*split._actors, *split._heads]))
    for ask, actor in zip([*asks.stages, *asks.heads], held, strict=True):
        # No GPU in the session's Ray: the actor asks host memory for what its plan holds; its
        # cap from the plan reaches it (and is not set: there is no GPU to set it on).
        assert ask.memory_bytes is not None
        assert actor["resources"] == {"CPU": 0.5, "memory": float(ask.memory_bytes)}
        assert actor["gpu_memory_limit_mib"] == ask.gpu_limit_mib is not None
        assert actor["device"] == "/CPU:0"
    # A part asks for its rows (half the head), not for a stage (blocks and a KV cache).
    head_asks = [a.planned_peak_bytes for a in asks.heads]
    assert max(head_asks) < min(a.planned_peak_bytes for a in asks.stages)
    assert [a.memory_bytes for a in asks.heads] == [p["params"] * 4 for p in held[2:]]
    table = ray.util.placement_group_table(split._group)
    assert list(table["bundles"].values()) == asks.bundles()


async def test_more_head_parts_than_ids_are_refused_by_name(
    ray_address: str, gpt2_preset: Path
) -> None:
    with pytest.raises(PlanError, match="head_parts must be between 1 and"):
        await start_generation_replicas(str(gpt2_preset), head_parts=10_000)
