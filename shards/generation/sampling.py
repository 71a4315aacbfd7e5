"""Per-row sampling from the last stage's logits (numpy; runs in the last stage actor).

keras_hub's samplers take one temperature for the batch; here every row has its own
``Sampling``. A seeded draw uses a generator keyed by (seed, token index) alone, so a row draws
the same token whether it runs alone, batched with others, or again after a re-prefill; an
unseeded one by (its ``draw_key``, token index) where the scheduler gave it one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shards.generation.contract import Sampling

__all__ = ["check_sampling", "draw_uniform", "sample_rows"]

_SEED_MASK = (1 << 64) - 1


def check_sampling(s: Sampling) -> str | None:
    """Why ``s`` cannot be sampled with, or None."""
    if not np.isfinite(s.temperature) or s.temperature < 0:
        return f"temperature must be a finite number >= 0, got {s.temperature}"
    if s.top_k < 0:
        return f"top_k must be >= 0 (0 = off), got {s.top_k}"
    if not 0.0 < s.top_p <= 1.0:
        return f"top_p must be in (0, 1] (1 = off), got {s.top_p}"
    return None


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - np.max(x)
    return shifted - np.log(np.sum(np.exp(shifted)))


def _generator(
    seed: int | None, token_index: int, fallback: np.random.Generator
) -> np.random.Generator:
    if seed is None:
        return fallback
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([seed & _SEED_MASK, token_index]))
    )


def draw_uniform(s: Sampling, token_index: int, fallback: np.random.Generator) -> float:
    """The one uniform number a sampled (not greedy) row's draw uses."""
    key = s.seed if s.seed is not None else s.draw_key  # a resumed sequence draws the same
    return float(_generator(key, token_index, fallback).random())


def _sample_one(
    logits: np.ndarray, s: Sampling, token_index: int, fallback: np.random.Generator
) -> tuple[int, float]:
    logits = logits.astype(np.float64)
    if s.temperature == 0.0:
        token = int(np.argmax(logits))
        return token, float(_log_softmax(logits)[token])
    logprobs = _log_softmax(logits / s.temperature)
    # Candidates by falling probability; ties by id, so the order never depends on the batch.
    order = np.lexsort((np.arange(logprobs.size), -logprobs))
    if 0 < s.top_k < order.size:
        order = order[: s.top_k]
    probs = np.exp(logprobs[order])
    if s.top_p < 1.0:
        cumulative = np.cumsum(probs) / np.sum(probs)
        # The smallest prefix whose mass reaches top_p (always at least the top token).
        keep = int(np.searchsorted(cumulative, s.top_p, side="left")) + 1
        order, probs = order[:keep], probs[:keep]
    probs = probs / np.sum(probs)
    u = draw_uniform(s, token_index, fallback)
    pick = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    token = int(order[min(pick, order.size - 1)])
    return token, float(logprobs[token])


def sample_rows(
    logits: np.ndarray,
    sampling: Sequence[Sampling],
    token_index: Sequence[int],
    fallback: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Sampled ids and their log-probabilities under the temperature-scaled distribution (the
    unscaled one for greedy rows), one per row of ``logits`` ``[rows, vocab]``."""
    ids = np.zeros((len(sampling),), np.int64)
    logprobs = np.zeros((len(sampling),), np.float32)
    for row, (s, t) in enumerate(zip(sampling, token_index, strict=True)):
        ids[row], logprobs[row] = _sample_one(logits[row], s, t, fallback)
    return ids, logprobs
