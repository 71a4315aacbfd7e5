"""What each actor of a generation replica asks of the cluster and caps its GPU at, from its plan.

The plan is ``partition.plan_generation`` (a stage: weights, KV cache for its slots, largest
step's activations) and ``partition.plan_head_parts`` (a head part: its vocabulary rows x hidden x
dtype, and its logits). From it, each actor's ask (issue 42 items 5 and 7):

- CPUs: ``num_cpus_per_stage`` each, head parts too (their matmul runs on as many threads).
- GPUs: a stage ``num_gpus_per_stage``; a head part the share of a stage's GPU that its planned
  peak is of the largest stage's, rounded up to a hundredth (a whole number past 1, as Ray takes
  them), so that parts pack onto a device beside each other instead of each taking a stage's.
- Host memory: without GPUs, Ray's ``memory`` resource at what the actor holds from step to step
  (weights and KV cache; a part its rows), so that a replica is placed only where that fits (a
  CPU stage of a partitioned model asks its plan too: ``shards.pipeline.placement``). Not the
  largest step's activations: every slot prefilling a whole slot at once is a worst case (2 GiB
  of attention scores for 8 slots x 2,048 positions x 4 heads) that would refuse models which run
  on the host as they are. On GPUs the plan is the device's, which Ray does not count.
- The GPU memory cap: the planned peak, largest step included, x the margin
  (``shards.actor.gpu_memory``), which the actor sets on its GPU before TensorFlow starts there
  (nothing without one); ``None`` where the ``gpu_memory_limit`` setting is off (memory growth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shards.actor.gpu_memory import gpu_memory_limit_mib
from shards.generation.partition import plan_generation, plan_head_parts
from shards.generation.preset import PresetSpec

__all__ = ["ActorAsk", "ReplicaAsks", "part_gpus", "replica_asks"]

# A head part's GPU share is rounded up to this step.
GPU_STEP = 0.01


@dataclass(frozen=True)
class ActorAsk:
    cpus: float
    gpus: float
    memory_bytes: int | None  # Ray's memory resource (a CPU actor's held bytes), None: none
    planned_peak_bytes: int  # held bytes + its largest step's activations
    gpu_limit_mib: int | None  # the TensorFlow allocator cap on its GPU; None: memory growth

    def bundle(self) -> dict[str, float]:
        """Its bundle in the replica's placement group."""
        bundle = {"CPU": float(self.cpus), "GPU": float(self.gpus)}
        if self.memory_bytes is not None:
            bundle["memory"] = float(self.memory_bytes)
        return {k: v for k, v in bundle.items() if v > 0}

    def options(self) -> dict[str, Any]:
        """Its Ray actor options (the resources half; they must fit its bundle)."""
        return {"num_cpus": self.cpus, "num_gpus": self.gpus, "memory": self.memory_bytes}


@dataclass(frozen=True)
class ReplicaAsks:
    stages: tuple[ActorAsk, ...]
    heads: tuple[ActorAsk, ...]  # empty: the last stage holds the head

    def bundles(self) -> list[dict[str, float]]:
        return [a.bundle() for a in (*self.stages, *self.heads)]


def part_gpus(stage_gpus: float, part_bytes: int, stage_bytes: int) -> float:
    """A head part's GPU share: ``stage_gpus`` x its planned peak over the largest stage's,
    rounded up to ``GPU_STEP`` (at least that), whole past 1, at most ``stage_gpus``."""
    if stage_gpus <= 0:
        return 0.0
    share = stage_gpus * part_bytes / max(stage_bytes, 1)
    if share >= stage_gpus:
        return stage_gpus
    if share > 1:
        return float(math.ceil(share))
    steps = math.ceil(round(share / GPU_STEP, 9))
    return min(stage_gpus, max(1, steps) * GPU_STEP)


def replica_asks(
    spec: PresetSpec,
    stages: int,
    kv_slots: int,
    max_length: int,
    head_parts: int = 1,
    *,
    cpus: float = 1.0,
    gpus: float = 0.0,
    gpu_memory_limit: bool = True,
) -> ReplicaAsks:
    """Each stage's and head part's ask, in the order the replica starts them."""

    def ask(actor_gpus: float, held: int, peak: int) -> ActorAsk:
        return ActorAsk(
            cpus=cpus,
            gpus=actor_gpus,
            memory_bytes=None if gpus else held,
            planned_peak_bytes=peak,
            gpu_limit_mib=gpu_memory_limit_mib(peak) if gpu_memory_limit else None,
        )

    plans = plan_generation(spec, stages, kv_slots, max_length, head_parts)
    widest = max(p.planned_peak_bytes for p in plans)
    return ReplicaAsks(
        stages=tuple(ask(gpus, p.total_bytes, p.planned_peak_bytes) for p in plans),
        heads=tuple(
            ask(part_gpus(gpus, p.planned_peak_bytes, widest), p.weight_bytes, p.planned_peak_bytes)
            for p in plan_head_parts(spec, head_parts, kv_slots)
        ),
    )
