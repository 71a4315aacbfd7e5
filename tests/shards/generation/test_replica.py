"""Generation replicas on real Ray actors: greedy equality with keras_hub's ``generate``, seeded
draws, a bad row failing alone, and a killed stage's sequences prefilled again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio
import ray

from shards.errors import InsufficientResourcesError, PipelineStartError
from shards.generation import (
    ReplicaLost,
    RowStep,
    Sampling,
    StepFailed,
    start_generation_replicas,
)
from shards.generation.partition import cut_blocks, kv_cache_bytes, stage_params
from shards.generation.preset import read_preset
from shards.generation.replica import Replica
from shards.generation.weights import stage_files
from tests.generation_models import GPT2_VOCABULARY, TOTAL_LENGTH, Greedy

pytestmark = pytest.mark.asyncio(loop_scope="module")
SLOTS = 4


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["gpt2", "llama"])
async def served(
    request: pytest.FixtureRequest, ray_address: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Replica, Greedy]]:
    greedy: Greedy = request.getfixturevalue(f"{request.param}_greedy")
    (replica,) = await start_generation_replicas(
        str(greedy.preset),
        stages=2,
        kv_slots=SLOTS,
        max_sequence_length=32,
        # Small CPU shares: both stages fit beside other tests' pipelines on the session's 4.
        num_cpus_per_stage=0.5,
        max_restarts=3,
        ready_timeout_s=120.0,
        stage_cache_dir=str(tmp_path_factory.mktemp("stage-files")),
    )
    try:
        yield replica, greedy
    finally:
        await replica.close()


@dataclass
class _Seq:
    prompt: tuple[int, ...]
    max_tokens: int
    arrives: int  # the scheduler step it may start at
    sampling: Sampling = field(default_factory=Sampling)
    slot: int | None = None
    generated: list[int] = field(default_factory=list)
    prefilled: bool = False

    def row(self) -> RowStep:
        assert self.slot is not None
        if not self.prefilled:
            tokens = self.prompt + tuple(self.generated)  # a re-prefill brings what it has
            return RowStep(self.slot, tokens, 0, self.sampling, len(self.generated))
        return RowStep(
            self.slot,
            (self.generated[-1],),
            len(self.prompt) + len(self.generated) - 1,
            self.sampling,
            len(self.generated),
        )

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_tokens


@dataclass
class _Ran:
    rows_per_step: list[int] = field(default_factory=list)
    lost: int = 0  # ReplicaLost seen


async def _run(replica: Replica, seqs: Sequence[_Seq], kill_at: int | None = None) -> _Ran:
    """A small iteration-level scheduler: each step's rows in two groups in flight at once (the
    pipeline's two stages busy), prompts joining as slots free."""
    ran = _Ran()
    free = list(range(SLOTS))
    tick = 0
    while not all(s.done for s in seqs):
        for s in seqs:
            if s.slot is None and not s.done and s.arrives <= tick and free:
                s.slot = free.pop(0)
        running = [s for s in seqs if s.slot is not None and not s.done]
        groups = [g for g in (running[::2], running[1::2]) if g]
        if tick == kill_at:
            ray.kill(replica._actors[1], no_restart=False)
        try:
            results = await asyncio.gather(*(replica.step([s.row() for s in g]) for g in groups))
        except ReplicaLost:
            ran.lost += 1
            await replica.wait_ready()
            for s in seqs:
                s.prefilled = False  # every slot is lost: prefill again from the tokens so far
            kill_at = None
            continue
        for group, result in zip(groups, results, strict=True):
            for s, r in zip(group, result, strict=True):
                assert r.slot == s.slot
                s.generated.append(r.token_id)
                s.prefilled = True
                if s.done:
                    free.append(s.slot)
                    s.slot = None
        ran.rows_per_step.append(len(running))
        tick += 1
    return ran


def _staggered(greedy: Greedy) -> list[_Seq]:
    # Different max_tokens and arrivals: prefills join decodes at other positions, and the
    # fifth prompt waits for a slot.
    return [
        _Seq(p, max_tokens=TOTAL_LENGTH - len(p) - (3 * i) % 5, arrives=2 * i)
        for i, p in enumerate(greedy.prompts)
    ]


async def test_greedy_equals_generate_token_for_token(served: tuple[Replica, Greedy]) -> None:
    replica, greedy = served
    assert replica.info.stages == 2 and replica.info.kv_slots == SLOTS
    spec = read_preset(str(greedy.preset))
    held = await asyncio.gather(*(a.describe.remote() for a in replica._actors))
    for cut, stage in zip(cut_blocks(spec.num_layers, 2), held, strict=True):
        # Each actor built only its blocks, from its own stage file.
        assert stage["from_stage_file"] and stage["blocks"] == [cut.first, cut.last]
        assert stage["params"] == stage_params(spec, cut, spec.num_layers)
        assert stage["kv_cache_bytes"] == kv_cache_bytes(spec, cut.blocks, SLOTS, 32)
    seqs = _staggered(greedy)
    ran = await _run(replica, seqs)
    for s, expected in zip(seqs, greedy.generated, strict=True):
        assert tuple(s.generated) == expected[: s.max_tokens]
    assert ran.lost == 0
    assert max(ran.rows_per_step) == SLOTS  # rows at their own positions shared steps


async def test_a_seeded_draw_repeats_alone_and_batched(served: tuple[Replica, Greedy]) -> None:
    replica, greedy = served
    sampling = Sampling(temperature=1.5, top_k=40, top_p=0.95, seed=11)
    alone = _Seq(greedy.prompts[0], max_tokens=8, arrives=0, sampling=sampling)
    await _run(replica, [alone])
    batched = _Seq(greedy.prompts[0], max_tokens=8, arrives=1, sampling=sampling)
    others = [_Seq(p, max_tokens=6, arrives=0) for p in greedy.prompts[1:3]]
    await _run(replica, [*others, batched])
    assert batched.generated == alone.generated
    # Sampled, not greedy: a hot temperature leaves the greedy path.
    assert tuple(alone.generated) != greedy.generated[0][:8]


async def test_an_id_outside_the_vocabulary_fails_only_its_row(
    served: tuple[Replica, Greedy],
) -> None:
    replica, greedy = served
    vocab = replica.info.vocabulary_size
    good = RowStep(0, greedy.prompts[1], 0, Sampling(), 0)
    bad = RowStep(1, (3, vocab + 5), 0, Sampling(), 0)
    with pytest.raises(StepFailed, match=f"token id {vocab + 5} is outside the vocabulary") as info:
        await replica.step([good, bad])
    assert info.value.slots == (1,)
    (result,) = await replica.step([good])
    assert result.token_id == greedy.generated[1][0]


# Faults are handled alike for every family: one is enough (each restart costs seconds).
@pytest.mark.parametrize("served", ["gpt2"], indirect=True)
async def test_a_killed_stage_is_lost_then_prefilled_again_to_the_same_tokens(
    served: tuple[Replica, Greedy],
) -> None:
    replica, greedy = served
    seqs = _staggered(greedy)[:3]
    ran = await _run(replica, seqs, kill_at=5)
    assert ran.lost == 1
    for s, expected in zip(seqs, greedy.generated[:3], strict=True):
        assert tuple(s.generated) == expected[: s.max_tokens]
    # And the replica serves on: a fresh prompt to its greedy end.
    again = _Seq(greedy.prompts[3], max_tokens=4, arrives=0)
    await _run(replica, [again])
    assert tuple(again.generated) == greedy.generated[3][:4]


# Faults are handled alike for every family: one is enough (each restart costs seconds).
@pytest.mark.parametrize("served", ["gpt2"], indirect=True)
async def test_a_step_past_its_timeout_restarts_the_stages_and_is_lost(
    served: tuple[Replica, Greedy], monkeypatch: pytest.MonkeyPatch
) -> None:
    replica, greedy = served
    before = await asyncio.gather(*(a.ready.remote() for a in replica._actors))
    # No step crosses two actors in 0.1 ms: as a hung stage would, this one runs past its limit.
    monkeypatch.setattr(replica, "_step_timeout_s", 1e-4)
    with pytest.raises(ReplicaLost, match="ran past"):
        await replica.step([RowStep(0, greedy.prompts[0], 0, Sampling(), 0)])
    with pytest.raises(ReplicaLost):
        await replica.step([RowStep(0, greedy.prompts[0], 0, Sampling(), 0)])
    monkeypatch.setattr(replica, "_step_timeout_s", 60.0)
    await replica.wait_ready()
    after = await asyncio.gather(*(a.ready.remote() for a in replica._actors))
    assert all(b != a for b, a in zip(before, after, strict=True))  # every stage restarted
    seq = _Seq(greedy.prompts[0], max_tokens=3, arrives=0)
    await _run(replica, [seq])
    assert tuple(seq.generated) == greedy.generated[0][:3]


async def test_a_keras_file_generates_as_its_preset_does(
    ray_address: str,
    gpt2_keras: Path,
    gpt2_greedy: Greedy,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    (replica,) = await start_generation_replicas(
        str(gpt2_keras),
        stages=1,
        kv_slots=2,
        num_cpus_per_stage=0.5,
        ready_timeout_s=120.0,
        stage_cache_dir=str(tmp_path_factory.mktemp("keras-stage-files")),
    )
    try:
        info = replica.info
        assert (info.model_family, info.stages, info.max_length) == ("gpt2", 1, 32)
        assert info.tokenizer_kind == "byte_bpe" and info.tokenizer_dir is not None
        assert (Path(info.tokenizer_dir) / "vocabulary.json").is_file()
        assert info.end_token_ids == (GPT2_VOCABULARY["<|endoftext|>"],)
        seq = _Seq(gpt2_greedy.prompts[1], max_tokens=5, arrives=0)
        await _run(replica, [seq])
        assert tuple(seq.generated) == gpt2_greedy.generated[1][:5]
    finally:
        await replica.close()


async def test_stages_the_cluster_cannot_hold_are_refused_at_once(
    ray_address: str, gpt2_preset: Path
) -> None:
    with pytest.raises(InsufficientResourcesError, match="GPU"):
        await start_generation_replicas(str(gpt2_preset), stages=2, num_gpus_per_stage=1.0)
    # Each stage asks Ray's memory resource for its weights and KV cache: ~33 GB of slots.
    with pytest.raises(InsufficientResourcesError, match="lower kv_slots, max_sequence_length"):
        await start_generation_replicas(str(gpt2_preset), stages=2, kv_slots=1_000_000)


async def test_a_stage_that_cannot_load_fails_the_start_with_its_reason(
    ray_address: str, gpt2_preset: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "stage-files"
    spec = read_preset(str(gpt2_preset))
    cuts = cut_blocks(spec.num_layers, 2)
    files = stage_files(str(gpt2_preset), cuts, str(cache))
    Path(files[1]).write_bytes(b"not an npz")  # the cache entry is complete, its file broken
    with pytest.raises(PipelineStartError, match="a generation stage did not start"):
        await asyncio.wait_for(
            start_generation_replicas(
                str(gpt2_preset),
                stages=2,
                num_cpus_per_stage=0.5,
                ready_timeout_s=120.0,
                stage_cache_dir=str(cache),
            ),
            timeout=90.0,
        )
