"""Cutting a generating model into stages of decoder blocks, and what each stage holds.

TF-free: it reads the preset's ``PresetSpec``. Stage 0 holds the embeddings and blocks
``[0, a)``; the last holds its blocks, the final norm and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

from shards.errors import PlanError
from shards.generation.preset import PresetSpec

__all__ = ["StageCut", "cut_blocks", "kv_cache_bytes", "resolve_max_length"]


@dataclass(frozen=True)
class StageCut:
    index: int
    first: int  # first decoder block
    last: int  # one past the last

    @property
    def blocks(self) -> int:
        return self.last - self.first


def cut_blocks(num_layers: int, stages: int) -> list[StageCut]:
    """A balanced cut of ``num_layers`` blocks into ``stages`` ranges (the first stages take one
    more block where they do not divide evenly)."""
    if not 1 <= stages <= num_layers:
        raise PlanError(
            f"stages must be between 1 and the model's {num_layers} decoder blocks, got {stages}"
        )
    size, extra = divmod(num_layers, stages)
    cuts = []
    first = 0
    for index in range(stages):
        last = first + size + (1 if index < extra else 0)
        cuts.append(StageCut(index, first, last))
        first = last
    return cuts


def resolve_max_length(spec: PresetSpec, max_sequence_length: int | None) -> int:
    """The slot length: ``max_sequence_length`` or the model's own bound (GPT-2's position rows);
    a model with none (RoPE) takes ``DEFAULT_MAX_LENGTH``."""
    if max_sequence_length is None:
        return spec.default_max_length
    if max_sequence_length < 1:
        raise PlanError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    bound = spec.max_length_bound
    if bound is not None and max_sequence_length > bound:
        raise PlanError(
            f"max_sequence_length {max_sequence_length} is past the model's {bound} position "
            f"rows; use at most {bound}"
        )
    return max_sequence_length


def kv_cache_bytes(spec: PresetSpec, blocks: int, kv_slots: int, max_length: int) -> int:
    """What a stage's KV cache holds: slots (plus the scratch slot padded tokens write into) x
    slot length x its blocks x 2 (keys, values) x kv heads x head dim x dtype bytes."""
    return (
        (kv_slots + 1) * max_length * blocks * 2 * spec.kv_heads * spec.head_dim * spec.dtype_bytes
    )
