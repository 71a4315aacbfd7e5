"""Generating text with a causal LM cut into stages of decoder blocks (issue 39, the back end).

The front end (``serving/generation/``) imports only the names exported here:

- the contract (``contract.py``): ``Sampling``, ``RowStep``, ``RowResult``, ``GenerationInfo``,
  ``StepFailed``, ``ReplicaLost``, ``GenerationReplica``;
- ``is_generating_model(path) -> bool``: a keras_hub preset directory of a supported family
  (reads ``metadata.json``/``config.json`` only: no TensorFlow, cheap);
- ``start_generation_replicas(model_path, *, stages=None, kv_slots=8, max_sequence_length=None,
  replicas=1, num_gpus_per_stage=0.0, num_cpus_per_stage=1.0, max_restarts=3,
  ready_timeout_s=300.0, stage_cache_dir=None, step_timeout_s=None, head_parts=1,
  gpu_memory_limit=True) -> list[GenerationReplica]`` (async; needs Ray initialised in the
  driver). ``head_parts`` > 1 splits the LM head by vocabulary rows into that many part actors
  beside the stages, each sampling its slice locally (``head_merge``: exact greedy, top-k, top-p
  and log-probabilities). A step past ``step_timeout_s`` (a hung stage; None: no limit) restarts
  the replica's stages and raises ``ReplicaLost``. Each actor asks Ray for what its plan holds
  and caps its GPU at it (``sizing``; ``gpu_memory_limit=False``: memory growth). Each stage's
  layers are written to a file once (under ``stage_cache_dir``, by default shardserve's stage
  cache) so an actor loads only its own.

Importing this package imports neither TensorFlow nor Ray: those load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shards.generation.contract import (
    GenerationInfo,
    GenerationReplica,
    ReplicaLost,
    RowResult,
    RowStep,
    Sampling,
    StepFailed,
)
from shards.generation.preset import is_generating_model

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "GenerationInfo",
    "GenerationReplica",
    "ReplicaLost",
    "RowResult",
    "RowStep",
    "Sampling",
    "StepFailed",
    "is_generating_model",
    "start_generation_replicas",
]


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
    stage_cache_dir: str | None = None,
    step_timeout_s: float | None = None,
    head_parts: int = 1,
    gpu_memory_limit: bool = True,
) -> Sequence[GenerationReplica]:
    """Start ``replicas`` replicas of the preset at ``model_path``; returns once all are warm."""
    from shards.generation.replica import start_generation_replicas as _start

    return await _start(
        model_path,
        stages=stages,
        kv_slots=kv_slots,
        max_sequence_length=max_sequence_length,
        replicas=replicas,
        num_gpus_per_stage=num_gpus_per_stage,
        num_cpus_per_stage=num_cpus_per_stage,
        max_restarts=max_restarts,
        ready_timeout_s=ready_timeout_s,
        stage_cache_dir=stage_cache_dir,
        step_timeout_s=step_timeout_s,
        head_parts=head_parts,
        gpu_memory_limit=gpu_memory_limit,
    )
