"""The body of one generation stage actor: a ``StageModel``, its KV cache, and (last) sampling.

A plain class; ``replica.py`` wraps it with ``ray.remote``. TensorFlow is imported inside the
methods, so the driver importing this module loads none.

A restarted actor has an empty cache. Each start draws a new ``incarnation``; the driver sends the
one it saw at ``ready()`` with every step, and a step meant for an earlier incarnation is refused
(``ReplicaLostError``) instead of reading a cache that no longer holds its sequences.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shards.errors import ModelError, ReplicaLostError, one_line
from shards.generation.contract import Sampling
from shards.generation.preset import read_preset
from shards.generation.sampling import sample_rows

__all__ = ["GenerationStage", "assigned_resources"]

log = logging.getLogger(__name__)


class GenerationStage:
    def __init__(
        self,
        model_path: str,
        first: int,
        last: int,
        kv_slots: int,
        max_length: int,
        warm_buckets: Sequence[tuple[int, int, int]] = (),
        weights_file: str | None = None,
        head: bool = True,
        memory_limit_mib: int | None = None,
    ) -> None:
        from shards.actor.stage_actor import _configure_tensorflow
        from shards.generation.stage import StageModel

        # A GPU capped at the stage's plan (weights, KV cache, largest step) before TensorFlow
        # starts on it (``sizing``); None: memory growth. Nothing is set without a GPU.
        self._device = _configure_tensorflow(memory_limit_mib)
        self._memory_limit_mib = memory_limit_mib
        if weights_file is not None and not Path(weights_file).is_file():
            # Written on the driver's node: another node reads the preset whole instead.
            log.info("stage file not on this node; stage [%d, %d) reads the preset", first, last)
            weights_file = None
        self._from_file = weights_file is not None
        self._model = StageModel(
            read_preset(model_path), first, last, kv_slots, max_length, weights_file, head
        )
        for rows, new, context in warm_buckets:
            self._model.warm_up(rows, new, context)
        self._rng = np.random.default_rng()
        self.incarnation = uuid.uuid4().hex

    def ready(self) -> str:
        return self.incarnation

    def describe(self) -> dict[str, object]:
        """What this stage holds: its blocks, its parameters, whether it loaded its own file."""
        return {
            "blocks": [self._model.first, self._model.last],
            "params": self._model.params,
            "from_stage_file": self._from_file,
            "kv_cache_bytes": self._model.kv_cache_bytes,
            # The cap it was given (set only where it has a GPU) and what Ray gave it.
            "gpu_memory_limit_mib": self._memory_limit_mib,
            "device": self._device.name,
            "resources": assigned_resources(),
        }

    def forward(
        self,
        x: np.ndarray,
        slots: np.ndarray,
        positions: np.ndarray,
        lengths: np.ndarray,
        context: int,
        incarnation: str,
        sampling: Sequence[Sampling] | None = None,
        token_index: Sequence[int] | None = None,
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Hidden states for the next stage, or (last stage) the sampled ids and their
        log-probabilities for the first ``len(sampling)`` rows; a last stage whose head is split
        (``head=False``) returns its normed hidden states ``[R, hidden]`` for the head parts."""
        if incarnation != self.incarnation:
            raise ReplicaLostError("the stage restarted: its KV cache no longer holds the slots")
        try:
            out = self._model.run(x, slots, positions, lengths, context)
        except Exception as exc:  # one line, no traceback: the driver maps it to StepFailed
            raise ModelError(one_line(exc), input_blamed=False) from None
        if not self._model.is_last or not self._model.head:
            return out
        assert sampling is not None and token_index is not None
        return sample_rows(out[: len(sampling)], sampling, token_index, self._rng)


def assigned_resources() -> dict[str, float]:
    """What Ray gave this actor: CPU, GPU and memory (bytes), by their plain names."""
    import ray

    given = ray.get_runtime_context().get_assigned_resources()
    return {k: float(v) for k, v in given.items() if k in ("CPU", "GPU", "memory")}
