"""The driver's side of a generation replica: K stage actors in one placement group.

``step()`` pads its rows to a shape bucket, chains one ``forward`` per stage, each taking the
previous stage's ObjectRef (the driver never waits between stages, and several steps in flight
pipeline: each actor runs one call at a time, in the order they were sent), and awaits only the
last stage's sampled ids. Nothing here blocks the event loop: refs are awaited. A step whose
one-token rows (decodes) sit beside longer ones (prefills) runs them as two such chains where that
pads fewer tokens (``split_by_length``).

With the LM head split by vocabulary rows (``head_parts`` > 1, issue 42 item 5), the last stage
answers its normed hidden states and each head part actor (``head_part.py``) a summary of its
slice's logits; the driver merges them (``head_merge``), asking a part again only for a row whose
top-p walk runs past the first candidates. Each actor's ask and GPU cap: ``sizing``.

Rows are checked before anything runs (slot, position, length, ids inside the vocabulary,
sampling parameters): a bad row raises ``StepFailed`` naming its slots, and the step runs none of
its rows, so the scheduler fails the bad ones and sends the others again. The model raising on a
step fails the step's rows (``StepFailed`` with all of them). A stage that died, or came back
empty after Ray restarted it, is ``ReplicaLost`` until ``wait_ready()``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shards.bundle.cache import ensure_private
from shards.bundle.shipping import default_cache_dir
from shards.cluster import check_cluster_fits
from shards.errors import PipelineStartError, PlanError, one_line
from shards.generation.actor import GenerationStage
from shards.generation.contract import (
    GenerationInfo,
    ReplicaLost,
    RowResult,
    RowStep,
    Sampling,
    StepFailed,
)
from shards.generation.head_merge import (
    CANDIDATES,
    Need,
    PartRows,
    merge_rows,
    slice_bounds,
    uniforms,
)
from shards.generation.head_part import HeadPart
from shards.generation.partition import StageCut, cut_blocks, resolve_max_length
from shards.generation.preset import PresetSpec, extract_tokenizer, read_preset, special_tokens
from shards.generation.sampling import check_sampling
from shards.generation.sizing import ReplicaAsks, replica_asks
from shards.generation.stage import bucket, context_bucket, decode_buckets
from shards.generation.weights import head_files, stage_files
from shards.pipeline.faults import is_replica_fault, translate

__all__ = ["Replica", "decode_buckets", "split_by_length", "start_generation_replicas"]

log = logging.getLogger(__name__)

_RemoteStage = ray.remote(GenerationStage)
_stage_files = ray.remote(stage_files)
_RemoteHead = ray.remote(HeadPart)
_MEMORY_FIX = (
    "what its stages hold (weights + KV cache of kv_slots x max_sequence_length) is more than the "
    "cluster's memory: lower kv_slots, max_sequence_length or replicas, or unload another model"
)
_head_files = ray.remote(head_files)


class Replica:
    """One pipeline of stage actors implementing ``contract.GenerationReplica``."""

    def __init__(
        self,
        info: GenerationInfo,
        spec: PresetSpec,
        actors: list[Any],
        group: PlacementGroup,
        ready_timeout_s: float,
        step_timeout_s: float | None = None,
        heads: Sequence[Any] = (),
    ) -> None:
        self.info = info
        self._spec = spec
        self._actors = actors
        self._heads = list(heads)  # head part actors, by vocabulary slice (none: the last stage's)
        self._rng = np.random.default_rng()  # unseeded draws of a split head's rows
        self._candidates = CANDIDATES  # a part's first candidates for a row without top-k
        # Rows of a split head whose parts were asked again (their walk ran past the first
        # candidates): for tests and the bench.
        self.rows_asked_again = 0
        self._group = group
        self._ready_timeout_s = ready_timeout_s
        self._step_timeout_s = step_timeout_s
        self._incarnations: list[str] = []
        self._lost = True  # until wait_ready() has seen every stage warm
        self._closed = False

    # --- checks before a step runs ---

    def _row_problem(self, row: RowStep, seen: set[int]) -> str | None:
        info = self.info
        if not 0 <= row.slot < info.kv_slots:
            return f"slot {row.slot} is outside 0..{info.kv_slots - 1}"
        if row.slot in seen:
            return f"slot {row.slot} appears twice in one step"
        n = len(row.token_ids)
        if n == 0:
            return "a row needs at least one new token"
        if row.position < 0 or row.position + n > info.max_length:
            return (
                f"positions {row.position}..{row.position + n - 1} do not fit the slot length "
                f"{info.max_length}"
            )
        for t in row.token_ids:
            if not 0 <= t < info.vocabulary_size:
                return f"token id {t} is outside the vocabulary (0..{info.vocabulary_size - 1})"
        if row.token_index < 0:
            return f"token_index must be >= 0, got {row.token_index}"
        return check_sampling(row.sampling)

    def _check(self, rows: Sequence[RowStep]) -> None:
        seen: set[int] = set()
        bad: list[int] = []
        reasons: list[str] = []
        for row in rows:
            problem = self._row_problem(row, seen)
            seen.add(row.slot)
            if problem is not None:
                bad.append(row.slot)
                reasons.append(problem)
        if bad:
            raise StepFailed("; ".join(reasons), bad)

    # --- the step ---

    def _pad(self, rows: Sequence[RowStep]) -> tuple[np.ndarray, ...]:
        r = bucket(len(rows), self.info.kv_slots)
        n = bucket(max(len(row.token_ids) for row in rows), self.info.max_length)
        ids = np.zeros((r, n), np.int32)
        # Padded rows read and write the scratch slot only (index kv_slots).
        slots = np.full((r,), self.info.kv_slots, np.int32)
        positions = np.zeros((r,), np.int32)
        lengths = np.zeros((r,), np.int32)
        for i, row in enumerate(rows):
            ids[i, : len(row.token_ids)] = row.token_ids
            slots[i] = row.slot
            positions[i] = row.position
            lengths[i] = len(row.token_ids)
        return ids, slots, positions, lengths

    def _context(self, rows: Sequence[RowStep]) -> int:
        """How many positions of its slots the step's attention reads: a bucket of the longest
        row's end, so short sequences do not pay for the whole slot."""
        return context_bucket(
            max(r.position + len(r.token_ids) for r in rows), self.info.max_length
        )

    def _submit(self, rows: Sequence[RowStep]) -> Any:
        """One forward per stage, each taking the previous stage's ObjectRef; the last's ref
        (with a split head: a coroutine merging the head parts' answers)."""
        ids, slots, positions, lengths = self._pad(rows)
        context = self._context(rows)
        ref: Any = ids
        last = len(self._actors) - 1
        for index, actor in enumerate(self._actors):
            args = (ref, slots, positions, lengths, context, self._incarnations[index])
            if index < last or self._heads:
                ref = actor.forward.remote(*args)
            else:
                sampling = [row.sampling for row in rows]
                ref = actor.forward.remote(*args, sampling, [row.token_index for row in rows])
        if self._heads:
            return self._merge_heads(ref, rows)
        return ref

    async def _merge_heads(
        self, hidden: Any, rows: Sequence[RowStep]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each row's token from the head parts' summaries of ``hidden`` (an ObjectRef of the
        last stage's ``[R, hidden]``): one round, a second for the rows whose walk ran past the
        first candidates, a third (every id) only after a rounding surprise (``head_merge``)."""
        sampling = [row.sampling for row in rows]
        # Sent when the step starts awaiting; the parts keep nothing between calls, so their
        # order against other steps does not matter (the stages' calls went out in order).
        first = [
            head.summarize.remote(hidden, sampling, None, None, self._candidates)
            for head in self._heads
        ]
        draws = uniforms(sampling, [row.token_index for row in rows], self._rng)
        answers = merge_rows(await asyncio.gather(*first), sampling, draws)
        for last_round in (False, True):
            pending = [r for r, a in enumerate(answers) if isinstance(a, Need)]
            if not pending:
                break
            if not last_round:
                self.rows_asked_again += len(pending)
            thresholds = [-np.inf if last_round else _threshold(answers[r]) for r in pending]
            subset: list[Sampling] = [sampling[r] for r in pending]
            more: list[PartRows] = await asyncio.gather(
                *(h.summarize.remote(hidden, subset, thresholds, pending) for h in self._heads)
            )
            for r, a in zip(
                pending, merge_rows(more, subset, [draws[r] for r in pending]), strict=True
            ):
                answers[r] = a
        ids = np.zeros((len(rows),), np.int64)
        logprobs = np.zeros((len(rows),), np.float32)
        for r, a in enumerate(answers):
            assert not isinstance(a, Need)  # the last round sends every id
            ids[r], logprobs[r] = a
        return ids, logprobs

    async def step(self, rows: Sequence[RowStep]) -> list[RowResult]:
        if self._closed:
            raise ReplicaLost("the replica is closed")
        if self._lost:
            raise ReplicaLost("a stage of this replica is lost: wait_ready(), then prefill again")
        if not rows:
            return []
        self._check(rows)
        groups = split_by_length(rows)
        # Sent one after the other before any wait: each stage takes them (and other steps) in
        # the order sent.
        refs = [self._submit([rows[i] for i in group]) for group in groups]
        try:
            answers = await asyncio.wait_for(asyncio.gather(*refs), self._step_timeout_s)
        except TimeoutError:
            self._restart_hung()
            raise ReplicaLost(
                f"a step ran past {self._step_timeout_s:g} s: the replica's stages are restarted; "
                "wait_ready(), then prefill again"
            ) from None
        except Exception as exc:
            error = translate(exc)
            if is_replica_fault(error):
                self._lost = True
                raise ReplicaLost(
                    "a stage of this replica was lost: wait_ready(), then prefill again"
                ) from None
            raise StepFailed(
                f"the model raised on this step: {error.message}", [row.slot for row in rows]
            ) from None
        results: list[RowResult | None] = [None] * len(rows)
        for group, (sampled, logprobs) in zip(groups, answers, strict=True):
            for i, t, lp in zip(group, sampled, logprobs, strict=True):
                results[i] = RowResult(slot=rows[i].slot, token_id=int(t), logprob=float(lp))
        return [r for r in results if r is not None]

    def _restart_hung(self) -> None:
        """A stage hung: Ray restarts every stage (their caches are lost with the step anyway),
        so no later step queues behind the hung one."""
        if self._lost:
            return
        self._lost = True
        log.warning(
            "a generation step ran past %g s; restarting the replica's stages", self._step_timeout_s
        )
        for actor in [*self._actors, *self._heads]:
            ray.kill(actor, no_restart=False)

    async def wait_ready(self, *, fail_fast: bool = False) -> None:
        """Wait until every stage answers (Ray restarts a dead one, which re-warms as it starts);
        ``ReplicaLost`` if they are not back within the ready timeout. ``fail_fast`` (at start):
        a stage that cannot start raises at once."""
        if self._closed:
            raise ReplicaLost("the replica is closed")
        deadline = time.monotonic() + self._ready_timeout_s
        while True:
            try:
                incarnations = await asyncio.gather(
                    *(a.ready.remote() for a in [*self._actors, *self._heads])
                )
            except ray.exceptions.RayError:
                if fail_fast:
                    raise
                # Dead for good (no restart left) looks the same from here: it ends at the
                # deadline.
                if time.monotonic() > deadline:
                    raise ReplicaLost("the replica's stages did not come back in time") from None
                await asyncio.sleep(0.2)
                continue
            self._incarnations = list(incarnations[: len(self._actors)])
            self._lost = False
            return

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for actor in [*self._actors, *self._heads]:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self._group)


def _threshold(answer: object) -> float:
    assert isinstance(answer, Need)
    return answer.threshold


def split_by_length(rows: Sequence[RowStep]) -> list[list[int]]:
    """The step's rows (by index) in the groups it runs as: a step is padded to its longest row,
    so rows of one new token (decodes) run apart from longer ones (prefills) where that pads
    fewer tokens: 7 decodes beside one 64-token prefill run 8 + 64 tokens, not 8 x 64."""
    short = [i for i, r in enumerate(rows) if len(r.token_ids) == 1]
    long = [i for i, r in enumerate(rows) if len(r.token_ids) > 1]
    if not short or not long:
        return [list(range(len(rows)))]
    cap = 1 << 30

    def padded(group: list[int]) -> int:
        width = max(len(rows[i].token_ids) for i in group)
        return bucket(len(group), cap) * bucket(width, cap)

    together = padded(list(range(len(rows))))
    return [short, long] if padded(short) + padded(long) < together else [list(range(len(rows)))]


async def _start_one(
    spec: PresetSpec,
    info: GenerationInfo,
    cuts: Sequence[StageCut],
    files: Sequence[str | None],
    *,
    head_files: Sequence[str] = (),
    asks: ReplicaAsks,
    max_restarts: int,
    ready_timeout_s: float,
    step_timeout_s: float | None,
) -> Replica:
    bundles = asks.bundles()
    group = placement_group(bundles, strategy="PACK")
    try:
        await asyncio.wait_for(group.ready(), timeout=ready_timeout_s)
    except TimeoutError:
        remove_placement_group(group)
        raise PipelineStartError(
            f"the cluster did not give the {len(bundles)} actors' bundles {bundles} within "
            f"{ready_timeout_s:g} s"
        ) from None
    warm = decode_buckets(info.kv_slots, info.max_length)
    actors = [
        _RemoteStage.options(
            **asks.stages[index].options(),
            max_restarts=max_restarts,
            # A step that killed a stage would kill it again: no transparent retries.
            max_task_retries=0,
            max_concurrency=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index
            ),
        ).remote(
            spec.path,
            cut.first,
            cut.last,
            info.kv_slots,
            info.max_length,
            warm,
            files[index],
            not head_files,
            asks.stages[index].gpu_limit_mib,
        )
        for index, cut in enumerate(cuts)
    ]
    heads = [
        _RemoteHead.options(
            **asks.heads[index].options(),  # from its rows, not a stage's (``sizing``)
            max_restarts=max_restarts,
            max_task_retries=0,
            max_concurrency=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=len(cuts) + index
            ),
        ).remote(path, asks.heads[index].gpu_limit_mib)
        for index, path in enumerate(head_files)
    ]
    replica = Replica(info, spec, actors, group, ready_timeout_s, step_timeout_s, heads)
    try:
        # A constructor that raised (an unreadable stage file, too little memory) is not retried.
        await replica.wait_ready(fail_fast=True)
    except (ReplicaLost, ray.exceptions.RayError) as exc:
        await replica.close()
        raise PipelineStartError(f"a generation stage did not start: {one_line(exc)}") from None
    return replica


async def start_generation_replicas(
    model_path: str,
    *,
    stages: int | None = None,
    kv_slots: int = 8,
    max_sequence_length: int | None = None,
    replicas: int = 1,
    num_gpus_per_stage: float = 0.0,
    num_cpus_per_stage: float = 1.0,
    max_restarts: int = 3,
    ready_timeout_s: float = 300.0,
    stage_cache_dir: str | Path | None = None,
    step_timeout_s: float | None = None,
    head_parts: int = 1,
    gpu_memory_limit: bool = True,
) -> list[Replica]:
    """Start ``replicas`` replicas of the preset at ``model_path``; see the package docstring."""
    if kv_slots < 1:
        raise ValueError(f"kv_slots must be >= 1, got {kv_slots}")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if step_timeout_s is not None and step_timeout_s <= 0:
        raise ValueError(f"step_timeout_s must be > 0 or None, got {step_timeout_s}")
    spec = read_preset(model_path)
    max_length = resolve_max_length(spec, max_sequence_length)
    cuts = cut_blocks(spec.num_layers, 1 if stages is None else stages)
    try:
        slice_bounds(spec.vocabulary_size, head_parts)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    heads = head_parts if head_parts > 1 else 0
    asks = replica_asks(
        spec,
        len(cuts),
        kv_slots,
        max_length,
        head_parts,
        cpus=num_cpus_per_stage,
        gpus=num_gpus_per_stage,
        gpu_memory_limit=gpu_memory_limit,
    )
    # Refused at once where the cluster can never hold them (a placement group would wait).
    check_cluster_fits(asks.bundles(), replicas, "PACK", _MEMORY_FIX)
    # Each stage's layers written apart once (a Ray task: TensorFlow stays out of the driver).
    cache = str(stage_cache_dir) if stage_cache_dir is not None else str(default_cache_dir())
    if spec.archive:
        # A .keras file's tokenizer is inside it: on disk for the front end, keyed by the file.
        ensure_private(Path(cache))
        stat = Path(spec.path).stat()
        key = hashlib.sha256(f"{spec.path};{stat.st_size};{stat.st_mtime_ns}".encode())
        spec = extract_tokenizer(spec, Path(cache) / f"tokenizer-{key.hexdigest()[:32]}")
    end_ids, start_id = special_tokens(spec)
    # Both tasks sent before either is awaited: they run side by side where the CPUs allow.
    head_ref = _head_files.remote(model_path, heads, cache) if heads else None
    try:
        files: list[str | None] = list(await _stage_files.remote(model_path, cuts, cache))
    except ray.exceptions.RayError as exc:
        raise PipelineStartError(f"the stage files were not written: {one_line(exc)}") from None
    parts: list[str] = []
    if head_ref is not None:
        try:
            parts = list(await head_ref)
        except ray.exceptions.RayError as exc:
            raise PipelineStartError(
                f"the head part files were not written: {one_line(exc)}"
            ) from None
    info = GenerationInfo(
        model_family=spec.family,
        vocabulary_size=spec.vocabulary_size,
        max_length=max_length,
        kv_slots=kv_slots,
        stages=len(cuts),
        head_parts=max(1, heads),
        end_token_ids=end_ids,
        start_token_id=start_id if spec.add_start_token else None,
        tokenizer_dir=spec.tokenizer_dir,
        tokenizer_kind=spec.tokenizer_kind,
    )
    started = await asyncio.gather(
        *(
            _start_one(
                spec,
                info,
                cuts,
                files,
                head_files=parts,
                asks=asks,
                max_restarts=max_restarts,
                ready_timeout_s=ready_timeout_s,
                step_timeout_s=step_timeout_s,
            )
            for _ in range(replicas)
        ),
        return_exceptions=True,
    )
    errors = [r for r in started if isinstance(r, BaseException)]
    if errors:
        for r in started:
            if isinstance(r, Replica):
                await r.close()
        raise errors[0]
    return [r for r in started if isinstance(r, Replica)]
