"""One stage of a generating model: a range of decoder blocks, its KV cache and (last) the head.

A step carries ``rows`` sequences, each with its own slot, position and number of new tokens,
padded to a shape bucket ``[R, N]``. keras_hub's ``call_with_cache`` takes one cache index for the
whole batch, so the blocks run through keras_hub 0.32's hook for vLLM
(``keras_hub.src.vllm.context.vllm_context_scope``): every decoder block of the supported families
projects q/k/v itself (after RoPE at the per-token positions we publish) and hands them to
``_Attention``, the one attention function here: per-token cache write, per-row causal mask,
grouped kv heads. Norms, projections and MLPs stay keras_hub's own code, so a family is only its
embedding (``_FAMILY_EMBED``). The hook is private, static-shaped and thread-local: keras-hub is
pinned below the next minor, and ``tests/shards/generation`` checks the result token for token
against ``CausalLM.generate``.

Each token is handed to the blocks as its own batch row (``[T, 1, hidden]``, T = R * N), the layout
the hook was written for; the attention function folds it back to ``[R, N]``. Padded tokens (a
row's tokens past its count, and padded rows) write their keys and values into a scratch slot
(index ``kv_slots``) and never into a real one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shards.generation.preset import PresetSpec

__all__ = ["MIN_CONTEXT", "StageModel", "bucket", "context_bucket", "decode_buckets"]

# The shortest prefix of a slot attention reads: fewer, larger buckets for short sequences.
MIN_CONTEXT = 16


def bucket(n: int, cap: int) -> int:
    """The padded size for ``n``: the next power of two, at most ``cap`` (and at least ``n``)."""
    size = 1
    while size < n:
        size *= 2
    return max(n, min(size, cap))


def context_bucket(end: int, max_length: int) -> int:
    """The positions a step's attention reads, for rows ending (exclusive) at ``end`` at most."""
    return min(max_length, bucket(max(end, MIN_CONTEXT), max_length))


def decode_buckets(kv_slots: int, max_length: int) -> list[tuple[int, int, int]]:
    """Every shape a decode step (one new token a row) takes: rows x context buckets. Traced at
    start (each costs ~1 s a stage of 6 blocks x 512 on a CPU core), so that no sequence's
    tokens wait on a trace when it grows past a context bucket."""
    rows = sorted({bucket(r, kv_slots) for r in range(1, kv_slots + 1)})
    contexts = sorted({context_bucket(end, max_length) for end in range(1, max_length + 1)})
    return [(r, 1, c) for r in rows for c in contexts]


def _embed_gpt2(backbone: Any, ids: Any, positions: Any) -> Any:
    tokens = backbone.token_embedding(ids)
    learned = backbone.position_embedding(tokens, positions=positions)
    return backbone.embeddings_add((tokens, learned))


def _embed_llama(backbone: Any, ids: Any, positions: Any) -> Any:
    del positions  # RoPE: positions enter inside attention, through the hook's context
    return backbone.token_embedding(ids)


# A new family is its embedding here plus its name in preset.FAMILIES (Mistral and Qwen embed as
# Llama does; Gemma scales by sqrt(hidden_dim)), as long as its attention layer takes the hook.
_FAMILY_EMBED: dict[str, Callable[[Any, Any, Any], Any]] = {
    "gpt2": _embed_gpt2,
    "llama": _embed_llama,
}


class StageModel:
    """Blocks ``[first, last)`` of the preset's backbone, with the embeddings when ``first == 0``
    and the final norm + LM head when ``last == num_layers`` (``head=False``: the final norm
    only, its output ``[R, hidden]`` going to the head's part actors, issue 42)."""

    def __init__(
        self,
        spec: PresetSpec,
        first: int,
        last: int,
        kv_slots: int,
        max_length: int,
        weights_file: str | None = None,
        head: bool = True,
    ) -> None:
        import tensorflow as tf

        if not 0 <= first < last <= spec.num_layers:
            raise ValueError(
                f"blocks [{first}, {last}) out of range for {spec.num_layers} decoder blocks"
            )
        self.spec = spec
        self.first = first
        self.last = last
        self.is_first = first == 0
        self.is_last = last == spec.num_layers
        self.head = head
        self.kv_slots = kv_slots
        self.max_length = max_length
        if weights_file is not None:
            # Only this stage's layers are built and loaded (shards.generation.weights).
            from shards.generation.weights import build_stage_backbone

            backbone = build_stage_backbone(spec, first, last, weights_file, head)
            blocks = list(backbone.transformer_layers)
        else:
            # No stage file on this node: the preset is read whole and the stage keeps its
            # layers (the backbone holds them all while the stage lives).
            from shards.generation.weights import load_whole_backbone

            backbone = load_whole_backbone(spec)
            blocks = list(backbone.transformer_layers[first:last])
        self._blocks = blocks
        self._backbone = backbone
        self._family_embed = _FAMILY_EMBED[spec.family]
        self.hidden_dim = spec.hidden_dim
        self.dtype = backbone.compute_dtype
        # One variable per block, rows (key/value, slot + scratch, position) flattened into its
        # first axis: written in place by scatter and read by gather along that axis, a row of
        # kv heads x head dim at a time (a slice of a variable would copy it whole first).
        self._cache_shape = (2, kv_slots + 1, max_length, spec.kv_heads, spec.head_dim)
        self.caches = [
            tf.Variable(
                tf.zeros(
                    (2 * (kv_slots + 1) * max_length, spec.kv_heads, spec.head_dim),
                    dtype=self.dtype,
                ),
                trainable=False,
                name=f"kv_cache_{first + i}",
            )
            for i in range(last - first)
        ]
        self._steps: dict[tuple[int, int, int], Any] = {}

    @property
    def params(self) -> int:
        return int(self._backbone.count_params())

    @property
    def kv_cache_bytes(self) -> int:
        return sum(int(c.shape.num_elements()) * c.dtype.size for c in self.caches)

    def cache_array(self) -> np.ndarray:
        """The KV cache as ``[blocks, key/value, slots + scratch, positions, kv heads, head dim]``
        (a copy, for tests and inspection)."""
        return np.stack([c.numpy().reshape(self._cache_shape) for c in self.caches])

    # --- the compiled step, one per shape bucket ---

    def _step_fn(self, rows: int, new: int, context: int) -> Any:
        key = (rows, new, context)
        fn = self._steps.get(key)
        if fn is not None:
            return fn
        import tensorflow as tf

        x_spec = (
            tf.TensorSpec((rows, new), tf.int32)
            if self.is_first
            else tf.TensorSpec((rows, new, self.hidden_dim), self.dtype)
        )
        ints = tf.TensorSpec((rows,), tf.int32)
        # Traced once here and called as a concrete function: one graph per bucket, and no
        # "frequent retracing" warning for buckets that are new shapes by design.
        fn = tf.function(
            lambda x, slots, positions, lengths: self._forward(
                x, slots, positions, lengths, rows, new, context
            ),
            input_signature=[x_spec, ints, ints, ints],
            reduce_retracing=False,
        ).get_concrete_function()
        self._steps[key] = fn
        return fn

    def _forward(
        self,
        x: Any,
        slots: Any,
        positions: Any,
        lengths: Any,
        rows: int,
        new: int,
        context: int,
    ) -> Any:
        import tensorflow as tf
        from keras_hub.src.vllm.context import vllm_context_scope

        tokens = rows * new
        j = tf.range(new, dtype=tf.int32)[None, :]
        valid = j < lengths[:, None]  # [R, N]
        token_pos = positions[:, None] + j  # [R, N]
        scratch = tf.constant(self.kv_slots, tf.int32)
        write_slot = tf.where(valid, tf.broadcast_to(slots[:, None], (rows, new)), scratch)
        write_pos = tf.where(valid, token_pos, 0)
        # A padded token past the slot's end reads (and embeds) at the last position: its output
        # is thrown away, and its write went to the scratch slot.
        clipped = tf.minimum(token_pos, self.max_length - 1)
        attention = _Attention(
            self.caches,
            rows,
            new,
            tf.reshape(write_slot, (tokens,)),
            tf.reshape(write_pos, (tokens,)),
            tf.where(lengths > 0, slots, scratch),
            clipped,
            context,
            self.kv_slots + 1,
            self.max_length,
        )
        flat_pos = tf.reshape(clipped, (tokens, 1))
        if self.is_first:
            ids = tf.reshape(x, (tokens, 1))
            h = self._family_embed(self._backbone, ids, flat_pos)
        else:
            h = tf.reshape(x, (tokens, 1, self.hidden_dim))
        with vllm_context_scope(
            paged_attention_func=attention,
            positions=tf.reshape(clipped, (tokens,)),
            kv_caches=list(range(len(self._blocks))),
        ):
            for block in self._blocks:
                h = block(h, training=False)
        h = tf.reshape(h, (rows, new, self.hidden_dim))
        if not self.is_last:
            return h
        # Only each row's last new token is sampled from: the head runs on [R, hidden].
        last = tf.maximum(lengths - 1, 0)
        h = tf.gather(h, last, axis=1, batch_dims=1)
        h = self._backbone.layer_norm(h)
        if not self.head:
            return tf.cast(h, tf.float32)
        logits = self._backbone.token_embedding(h, reverse=True)
        return tf.cast(logits, tf.float32)

    def run(
        self,
        x: np.ndarray,
        slots: np.ndarray,
        positions: np.ndarray,
        lengths: np.ndarray,
        context: int | None = None,
    ) -> np.ndarray:
        """One step: hidden states ``[R, N, hidden]`` for the next stage, or logits ``[R, vocab]``
        from the last (which samples from them; they never leave its process). ``context``: how
        many positions of each slot attention reads (at least every row's position + its new
        tokens; the slot length by default), a bucket so that a short sequence reads a short
        prefix of its slot."""
        rows, new = int(x.shape[0]), int(x.shape[1])
        context = self.max_length if context is None else int(context)
        if not 1 <= context <= self.max_length:
            raise ValueError(f"context {context} is outside 1..{self.max_length}")
        fn = self._step_fn(rows, new, context)
        out = fn(x, slots.astype(np.int32), positions.astype(np.int32), lengths.astype(np.int32))
        return np.asarray(out.numpy())

    def warm_up(self, rows: int, new: int, context: int | None = None) -> None:
        """Trace the bucket ``(rows, new, context)`` on padded rows: they write only the scratch
        slot."""
        if self.is_first:
            x = np.zeros((rows, new), np.int32)
        else:
            x = np.zeros((rows, new, self.hidden_dim), np.dtype(self.dtype))
        zeros = np.zeros((rows,), np.int32)
        self.run(x, np.full((rows,), self.kv_slots, np.int32), zeros, zeros, context)


class _Attention:
    """The paged-attention function the keras_hub hook calls once per decoder block.

    ``cache_index`` is what we published as that block's cache (its index in ``caches``); the
    updated "cache" handed back is the same index, the variable having been written in place.
    """

    def __init__(
        self,
        caches: list[Any],
        rows: int,
        new: int,
        write_slot: Any,
        write_pos: Any,
        read_slot: Any,
        token_pos: Any,
        context: int,
        slots: int,
        max_length: int,
    ) -> None:
        self.caches = caches
        self.rows = rows
        self.new = new
        self.write_slot = write_slot
        self.write_pos = write_pos
        self.read_slot = read_slot
        self.token_pos = token_pos
        self.context = context
        self.slots = slots  # kv slots + the scratch one
        self.max_length = max_length

    def _row(self, kind: int, slot: Any, position: Any) -> Any:
        """The cache row of (key or value, slot, position), broadcast."""
        return (kind * self.slots + slot) * self.max_length + position

    def __call__(
        self,
        cache_index: int,
        query: Any,
        key: Any,
        value: Any,
        scale: float,
        head_dim: int,
        num_heads: int,
        kv_heads: int,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> tuple[int, Any]:
        import tensorflow as tf

        if sliding_window is not None or soft_cap is not None:
            raise NotImplementedError("sliding-window and soft-capped attention are not supported")
        rows, new = self.rows, self.new
        tokens = rows * new
        groups = num_heads // kv_heads
        key = tf.reshape(key, (tokens, kv_heads, head_dim))
        value = tf.reshape(value, (tokens, kv_heads, head_dim))
        cache = self.caches[cache_index]
        for kind, update in ((0, key), (1, value)):
            index = self._row(kind, self.write_slot, self.write_pos)
            cache.scatter_update(tf.IndexedSlices(tf.cast(update, cache.dtype), index))
        # Only the first `context` positions of each row's slot: no row reads past them.
        position = tf.range(self.context, dtype=tf.int32)[None, :]
        keys = cache.sparse_read(self._row(0, self.read_slot[:, None], position))  # [R, C, kv, D]
        values = cache.sparse_read(self._row(1, self.read_slot[:, None], position))
        q = tf.reshape(query, (rows, new, kv_heads, groups, head_dim))
        scores = tf.einsum("rnkgd,rlkd->rkgnl", q, tf.cast(keys, q.dtype))
        scores = tf.cast(scores, tf.float32) * scale
        allowed = tf.range(self.context)[None, None, :] <= self.token_pos[:, :, None]
        scores = tf.where(allowed[:, None, None, :, :], scores, tf.float32.min)
        probs = tf.cast(tf.nn.softmax(scores, axis=-1), q.dtype)
        out = tf.einsum("rkgnl,rlkd->rnkgd", probs, tf.cast(values, q.dtype))
        return cache_index, tf.reshape(out, (tokens, num_heads * head_dim))
