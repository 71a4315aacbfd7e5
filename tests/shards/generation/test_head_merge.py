"""A vocabulary head split by rows: the merged parts' summaries sample what the whole logits do
(``shards.generation.head_merge`` against ``sampling.sample_rows``), on random logits."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from shards.generation.contract import Sampling
from shards.generation.head_merge import (
    CANDIDATES,
    PartRows,
    sample_split,
    slice_bounds,
    summarize,
)
from shards.generation.sampling import sample_rows

VOCAB = 1000


def _split(
    logits: np.ndarray,
    parts: int,
    sampling: Sequence[Sampling],
    token_index: Sequence[int],
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Sampled as split parts would: ids, log-probabilities, rows asked again, and the most
    values any part sent for a row in the first round."""
    bounds = slice_bounds(logits.shape[1], parts)

    def first() -> list[PartRows]:
        return [summarize(logits[:, a:b], a, sampling) for a, b in bounds]

    def more(rows: list[int], thresholds: list[float]) -> list[PartRows]:
        return [
            summarize(logits[rows, a:b], a, [sampling[r] for r in rows], thresholds)
            for a, b in bounds
        ]

    summaries = first()
    widest = max(int(np.max(p.counts)) for p in summaries)
    ids, logprobs, asked = sample_split(
        summaries, more, sampling, token_index, np.random.default_rng(seed)
    )
    return ids, logprobs, asked, widest


def _whole(
    logits: np.ndarray, sampling: Sequence[Sampling], token_index: Sequence[int], seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    return sample_rows(logits, sampling, token_index, np.random.default_rng(seed))


def _logits(rows: int, scale: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(rows, VOCAB)) * scale).astype(np.float32)


def test_slices_cover_the_vocabulary_once() -> None:
    assert slice_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert slice_bounds(7, 1) == [(0, 7)]
    with pytest.raises(ValueError, match="head_parts"):
        slice_bounds(4, 5)


@pytest.mark.parametrize("parts", [2, 3, 7])
def test_greedy_ids_and_logprobs_equal_the_whole_head(parts: int) -> None:
    logits = _logits(32, 3.0, parts)
    sampling = [Sampling()] * 32
    ids, logprobs, asked, widest = _split(logits, parts, sampling, range(32))
    expected_ids, expected_logprobs = _whole(logits, sampling, range(32))
    assert ids.tolist() == expected_ids.tolist()
    np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-6, rtol=0)
    assert asked == 0 and widest == 1  # one candidate a part, never a second round


def test_greedy_ties_go_to_the_lowest_id_across_parts() -> None:
    logits = np.zeros((1, 10), np.float32)
    logits[0, [3, 8]] = 5.0  # a tie across the two parts' slices
    ids, _, _, _ = _split(logits, 2, [Sampling()], [0])
    assert ids.tolist() == [3] == _whole(logits, [Sampling()], [0])[0].tolist()


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=0.8, top_k=40, seed=5),
        Sampling(temperature=1.3, top_k=40, top_p=0.9, seed=6),
        Sampling(temperature=1.0, top_k=3, seed=7),
        Sampling(temperature=2.0, top_k=5000, seed=8),  # top_k past the vocabulary: all of it
    ],
)
def test_top_k_draws_equal_the_whole_head_in_one_round(sampling: Sampling) -> None:
    rows = 48
    logits = _logits(rows, 2.0, sampling.seed or 0)
    batch = [sampling] * rows
    ids, logprobs, asked, widest = _split(logits, 3, batch, range(rows))
    expected_ids, expected_logprobs = _whole(logits, batch, range(rows))
    assert ids.tolist() == expected_ids.tolist()
    np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-6, rtol=0)
    assert asked == 0 and widest <= sampling.top_k


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99, 1.0])
def test_peaked_top_p_and_temperature_draws_are_exact_from_the_first_candidates(
    top_p: float,
) -> None:
    # A language model's shape: a few ids hold the mass.
    rows = 64
    logits = _logits(rows, 6.0, 11)
    batch = [Sampling(temperature=0.7, top_p=top_p, seed=i) for i in range(rows)]
    ids, logprobs, asked, widest = _split(logits, 4, batch, range(rows))
    expected_ids, expected_logprobs = _whole(logits, batch, range(rows))
    assert ids.tolist() == expected_ids.tolist()
    np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-6, rtol=0)
    assert widest == CANDIDATES
    if top_p < 0.99:
        assert asked == 0


@pytest.mark.parametrize("top_p", [0.3, 0.95, 1.0])
def test_flat_distributions_ask_again_above_a_threshold_and_stay_exact(top_p: float) -> None:
    # Nearly flat: the nucleus is hundreds of ids, past any part's first candidates.
    rows = 40
    logits = _logits(rows, 0.05, 12)
    batch = [Sampling(temperature=1.0, top_p=top_p, seed=100 + i) for i in range(rows)]
    ids, logprobs, asked, _ = _split(logits, 2, batch, range(rows))
    expected_ids, expected_logprobs = _whole(logits, batch, range(rows))
    assert ids.tolist() == expected_ids.tolist()
    np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-6, rtol=0)
    assert asked > 0


def test_unseeded_rows_draw_from_the_fallback_generator_in_row_order() -> None:
    rows = 16
    logits = _logits(rows, 4.0, 13)
    batch = [Sampling(temperature=1.0, top_k=20)] * rows
    ids, _, _, _ = _split(logits, 2, batch, [0] * rows, seed=99)
    expected, _ = _whole(logits, batch, [0] * rows, seed=99)
    assert ids.tolist() == expected.tolist()


def test_mixed_rows_and_summaries_stay_small() -> None:
    rows = 8
    logits = _logits(rows, 3.0, 14)
    batch = [
        Sampling(),
        Sampling(temperature=0.9, top_k=10, seed=1),
        Sampling(temperature=1.1, top_p=0.8, seed=2),
        Sampling(temperature=0.5, seed=3),
    ] * 2
    ids, logprobs, _, _ = _split(logits, 2, batch, range(rows))
    expected_ids, expected_logprobs = _whole(logits, batch, range(rows))
    assert ids.tolist() == expected_ids.tolist()
    np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-6, rtol=0)
    part = summarize(logits[:, :500], 0, batch)
    # Never [rows, vocab]: per row a few scores and its candidates.
    assert part.nbytes < logits[:, :500].astype(np.float64).nbytes / 4
