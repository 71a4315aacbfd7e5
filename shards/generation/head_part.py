"""The body of one head part actor: a slice of the LM head by vocabulary rows (issue 42 item 5).

A plain class; ``replica.py`` wraps it with ``ray.remote``. It holds rows ``[offset, offset +
size)`` of the head (``weights.head_files``), takes the last stage's normed hidden states
``[R, hidden]`` and answers ``head_merge.summarize`` of its logits: a few scores and candidates per
row, never the ``[R, size]`` logits. It keeps nothing between steps (a later round for a row
computes its logits again from the same hidden states), so a restarted part serves on at once.

A tied table is held twice (measured, not changed; issue 42 item 3's generation analog): stage 0
keeps the whole token table for its lookup while the parts hold its rows again. GPT-2 small
(50,257 x 768, float32): 147.2 MiB twice, the replica's weights 621.9 MiB against the model's
474.7 MiB (+31%). An untied model's stage 0 holds its head matrix too (the ReversibleEmbedding
layer is kept whole), so it is held twice as well. Held once, the driver would send each step's
ids to the parts (it knows them) and stage 0 would join the rows they return (``TableRows``'
routed shape): one more actor hop ahead of stage 0 on every step; for 8 rows, 32 B of ids to a
part and 24.6 KB of rows back at decode, 25 MB at a prefill of 8 x 1,024 tokens. ``python -m
bench.tied_hop`` (stand-in stages, real 2-part slices, one step in flight), two runs at load
9-14: a decode step with the table in stage 0 57.7 / 41.7 ms against 62.3 / 43.4 ms held once,
**+4.6 / +1.7 ms (1.08x / 1.04x)** a step.
With several steps in flight a part would also take step n+1's lookup behind step n's logits
(one call at a time): the concurrency groups of issue 42 item 3 would be needed to overlap them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import numpy as np

from shards.generation.actor import assigned_resources
from shards.generation.contract import Sampling
from shards.generation.head_merge import CANDIDATES, PartRows, summarize

__all__ = ["HeadPart"]


class HeadPart:
    def __init__(self, weights_file: str, memory_limit_mib: int | None = None) -> None:
        from shards.actor.stage_actor import _configure_tensorflow

        # A GPU capped at the part's plan (its rows and logits, ``sizing``); None: growth.
        self._device = _configure_tensorflow(memory_limit_mib)
        self._memory_limit_mib = memory_limit_mib
        import tensorflow as tf

        with np.load(weights_file) as data:
            kernel = data["kernel"]
            self.offset = int(data["offset"])
        self.size = int(kernel.shape[0])
        self._kernel = tf.constant(kernel)
        self.incarnation = uuid.uuid4().hex

    def ready(self) -> str:
        return self.incarnation

    def describe(self) -> dict[str, object]:
        return {
            "offset": self.offset,
            "size": self.size,
            "params": int(self._kernel.shape[0]) * int(self._kernel.shape[1]),
            "gpu_memory_limit_mib": self._memory_limit_mib,
            "device": self._device.name,
            "resources": assigned_resources(),
        }

    def summarize(
        self,
        hidden: np.ndarray,
        sampling: Sequence[Sampling],
        thresholds: Sequence[float] | None = None,
        rows: Sequence[int] | None = None,
        candidates: int = CANDIDATES,
    ) -> PartRows:
        """The summary of the first ``len(sampling)`` rows of ``hidden`` (or of ``rows`` of it,
        in a later round with ``thresholds``)."""
        import tensorflow as tf

        picked = hidden[: len(sampling)] if rows is None else hidden[np.asarray(rows)]
        h = tf.cast(tf.constant(picked), self._kernel.dtype)
        logits = tf.cast(tf.matmul(h, self._kernel, transpose_b=True), tf.float32).numpy()
        return summarize(logits, self.offset, sampling, thresholds, candidates)
