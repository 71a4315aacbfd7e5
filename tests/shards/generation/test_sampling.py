"""Per-row sampling in the last stage: greedy, temperature, top-k, top-p, seeded draws."""

from __future__ import annotations

import numpy as np

from shards.generation.contract import Sampling
from shards.generation.sampling import check_sampling, sample_rows

LOGITS = np.log(np.array([[0.1, 0.2, 0.4, 0.3]], np.float32))


def _draws(sampling: Sampling, n: int = 400) -> list[int]:
    rng = np.random.default_rng(0)
    return [int(sample_rows(LOGITS, [sampling], [t], rng)[0][0]) for t in range(n)]


def test_greedy_takes_the_argmax_with_its_logprob() -> None:
    ids, logprobs = sample_rows(LOGITS, [Sampling()], [0], np.random.default_rng(0))
    assert ids.tolist() == [2]
    assert np.isclose(logprobs[0], np.log(0.4), atol=1e-6)


def test_a_seeded_draw_is_keyed_by_seed_and_token_index_alone() -> None:
    s = Sampling(temperature=1.0, seed=7)
    first = _draws(s, 50)
    # Another fallback generator, the row among others: the same draws.
    other = np.random.default_rng(123)
    batched = [
        int(
            sample_rows(np.repeat(LOGITS, 3, 0), [Sampling(1.0), s, Sampling()], [t, t, t], other)[
                0
            ][1]
        )
        for t in range(50)
    ]
    assert batched == first
    assert _draws(Sampling(temperature=1.0, seed=8), 50) != first
    assert len(set(first)) > 1  # the index moves the draw


def test_temperature_draws_follow_the_distribution() -> None:
    counts = np.bincount(_draws(Sampling(temperature=1.0, seed=1), 4000), minlength=4) / 4000
    assert np.allclose(counts, [0.1, 0.2, 0.4, 0.3], atol=0.03)


def test_top_k_and_top_p_keep_only_the_head() -> None:
    assert set(_draws(Sampling(temperature=1.0, top_k=2, seed=3))) == {2, 3}
    # 0.4 + 0.3 reach 0.7: top_p=0.7 keeps tokens 2 and 3; 0.5 keeps only 2 and 3 as well.
    assert set(_draws(Sampling(temperature=1.0, top_p=0.7, seed=3))) == {2, 3}
    assert set(_draws(Sampling(temperature=1.0, top_p=0.35, seed=3))) == {2}
    assert set(_draws(Sampling(temperature=1.0, top_k=1, seed=3))) == {2}


def test_the_logprob_is_under_the_temperature_scaled_distribution() -> None:
    s = Sampling(temperature=0.5, top_k=1, seed=0)
    ids, logprobs = sample_rows(LOGITS, [s], [0], np.random.default_rng(0))
    scaled = np.log(np.array([0.1, 0.2, 0.4, 0.3])) / 0.5
    expected = scaled[2] - np.log(np.exp(scaled).sum())
    assert ids.tolist() == [2] and np.isclose(logprobs[0], expected, atol=1e-6)


def test_bad_parameters_are_named() -> None:
    assert check_sampling(Sampling()) is None
    assert "temperature" in (check_sampling(Sampling(temperature=-1.0)) or "")
    assert "top_k" in (check_sampling(Sampling(top_k=-2)) or "")
    assert "top_p" in (check_sampling(Sampling(top_p=0.0)) or "")
    assert "top_p" in (check_sampling(Sampling(top_p=1.5)) or "")
