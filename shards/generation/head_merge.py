"""Sampling from a vocabulary head split by rows into parts: each part summarises its slice, the
driver merges the summaries into the token ``sampling.sample_rows`` would have drawn from the
whole logits (issue 42 item 5). Pure numpy: no TensorFlow, no Ray.

A part holding vocabulary ids ``[offset, offset + size)`` sends, per row, only:

- ``max`` and ``sum``: its largest (temperature-scaled) logit and the sum of ``exp(v - max)`` over
  its slice, from which the merge builds the global log-sum-exp, the normaliser of every
  log-probability (``log S = log sum_p sum_p * exp(max_p - M)``, ``M`` the largest ``max_p``);
- its candidates: global ids and scaled logits, by falling logit then id (the whole sampler's
  order), and ``floor``, a value every id it did not send is at or below.

**Why the merge is exact.** Within a part, the global order restricted to its ids is its own
order, so:

- *greedy*: the global argmax is one of the parts' top-1 (each part sends 1 candidate);
- *top-k* (``top_k > 0``, with or without ``top_p``): every id of the global top-k is in its
  part's top-k, so each part sends ``top_k`` candidates and the first ``top_k`` of the merged
  order are the global ones. top-p then cuts inside them, normalised by their own mass, as the
  whole sampler does: exact in one round;
- *top-p alone* and *temperature alone* (``top_k == 0``) walk the whole vocabulary's sorted order:
  the nucleus can be most of it (a flat distribution at ``top_p=0.95``), and a plain temperature
  draw can land anywhere in it. **No bounded candidate count is exact for them.** Each part
  first sends its top ``CANDIDATES``. Every merged candidate whose logit is above every
  incomplete part's ``floor`` is in its exact global place (an unsent id is at or below its
  part's floor). When the nucleus's end (top-p) or the draw (temperature alone) falls inside that
  exact prefix, the answer is exact: the usual case for a language model, whose mass sits in
  a few ids. Otherwise the row asks its parts again for every id whose probability is above
  ``tau = (1 - c) / (2 V)`` (``V`` the vocabulary, ``c`` = ``top_p``, or the uniform draw ``u``
  for temperature alone), the parts' sorted probabilities above a threshold. Proof that this
  suffices: the id ``j`` the walk stops at has mass before it below ``c``, so the ids from ``j``
  on hold more than ``1 - c`` in at most ``V`` ids, each at most ``p_j``: ``p_j > (1 - c) / V =
  2 tau``, so ``j`` and everything before it are sent. A third round (everything) covers only a
  rounding surprise. The cost is that of the distribution: a flat one sends most of the slice.

Greedy ids and top-k draws are exact; every log-probability is within a few ulps of the whole
sampler's (its normaliser is summed in another order), so a seeded draw differs only where the
uniform draw falls within ~1e-15 of a boundary between two ids' cumulative mass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from shards.generation.contract import Sampling
from shards.generation.sampling import draw_uniform

__all__ = [
    "CANDIDATES",
    "Need",
    "PartRows",
    "candidate_count",
    "merge_rows",
    "sample_split",
    "scaled",
    "slice_bounds",
    "summarize",
    "uniforms",
]

# Candidates a part sends first for a row sampling without top-k (top-p or temperature alone).
CANDIDATES = 64


def slice_bounds(vocabulary_size: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges ``[start, stop)`` of the vocabulary, the first ones one id
    longer where it does not divide evenly."""
    if not 1 <= parts <= vocabulary_size:
        raise ValueError(
            f"head_parts must be between 1 and the vocabulary's {vocabulary_size} ids, got {parts}"
        )
    size, extra = divmod(vocabulary_size, parts)
    bounds = []
    start = 0
    for index in range(parts):
        stop = start + size + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def candidate_count(s: Sampling, candidates: int = CANDIDATES) -> int:
    """How many candidates a part sends for a row in the first round (``candidates`` for a row
    sampling without top-k)."""
    if s.temperature == 0.0:
        return 1
    if s.top_k > 0:
        return s.top_k
    return candidates


def scaled(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """A row's logits as the sampler orders them: float64, divided by the temperature (greedy:
    as they are)."""
    values = logits.astype(np.float64)
    return values if s.temperature == 0.0 else values / s.temperature


@dataclass(frozen=True)
class PartRows:
    """One part's summary of a step's rows (what crosses from a part actor to the driver)."""

    offset: int
    size: int
    maxes: np.ndarray  # [R] float64
    sums: np.ndarray  # [R] float64: sum of exp(v - max) over the slice
    counts: np.ndarray  # [R] candidates per row
    ids: np.ndarray  # [sum(counts)] global ids, row after row
    values: np.ndarray  # [sum(counts)] their scaled logits
    floors: np.ndarray  # [R] every unsent id's value is <= floor (-inf when all were sent)

    def row(self, r: int) -> tuple[float, float, np.ndarray, np.ndarray, float]:
        start = int(np.sum(self.counts[:r]))
        stop = start + int(self.counts[r])
        return (
            float(self.maxes[r]),
            float(self.sums[r]),
            self.ids[start:stop],
            self.values[start:stop],
            float(self.floors[r]),
        )

    @property
    def nbytes(self) -> int:
        arrays = (self.maxes, self.sums, self.counts, self.ids, self.values, self.floors)
        return sum(int(a.nbytes) for a in arrays)


def _ordered(values: np.ndarray, picked: np.ndarray) -> np.ndarray:
    """``picked`` indices by falling value, then id."""
    return picked[np.lexsort((picked, -values[picked]))]


def _top(values: np.ndarray, count: int) -> np.ndarray:
    """Indices of the ``count`` first in (falling value, then id) order, in that order."""
    n = values.size
    if count >= n:
        return _ordered(values, np.arange(n))
    kth = np.partition(values, n - count)[n - count]  # the count-th largest value
    above = np.flatnonzero(values > kth)
    ties = np.flatnonzero(values == kth)[: count - above.size]
    return _ordered(values, np.concatenate([above, ties]))


def summarize(
    logits: np.ndarray,
    offset: int,
    sampling: Sequence[Sampling],
    thresholds: Sequence[float] | None = None,
    candidates: int = CANDIDATES,
) -> PartRows:
    """A part's summary of its logits ``[rows, size]`` (ids ``offset ..``): per row its
    ``candidate_count`` first ids, or (``thresholds``, a later round) every id whose scaled logit
    is at least the row's threshold."""
    rows, size = int(logits.shape[0]), int(logits.shape[1])
    maxes = np.zeros((rows,), np.float64)
    sums = np.zeros((rows,), np.float64)
    counts = np.zeros((rows,), np.int64)
    floors = np.full((rows,), -np.inf, np.float64)
    ids: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for r, s in enumerate(sampling):
        v = scaled(logits[r], s)
        maxes[r] = np.max(v)
        sums[r] = np.sum(np.exp(v - maxes[r]))
        if thresholds is None:
            picked = _top(v, candidate_count(s, candidates))
            if picked.size < size:
                floors[r] = v[picked[-1]]
        else:
            picked = _ordered(v, np.flatnonzero(v >= thresholds[r]))
            if picked.size < size:
                floors[r] = thresholds[r]
        counts[r] = picked.size
        ids.append(picked.astype(np.int64) + offset)
        values.append(v[picked])
    return PartRows(
        offset,
        size,
        maxes,
        sums,
        counts,
        np.concatenate(ids) if ids else np.zeros((0,), np.int64),
        np.concatenate(values) if values else np.zeros((0,), np.float64),
        floors,
    )


@dataclass(frozen=True)
class Need:
    """The row needs every id whose scaled logit is at least ``threshold`` from every part."""

    threshold: float


def _merge_one(
    parts: Sequence[tuple[float, float, np.ndarray, np.ndarray, float]],
    s: Sampling,
    u: float | None,
    vocabulary: int,
) -> tuple[int, float] | Need:
    maxes = np.array([p[0] for p in parts])
    top = float(np.max(maxes))
    log_total = float(np.log(np.sum(np.array([p[1] for p in parts]) * np.exp(maxes - top))))
    ids = np.concatenate([p[2] for p in parts])
    values = np.concatenate([p[3] for p in parts])
    logprobs = (values - top) - log_total
    order = np.lexsort((ids, -logprobs))
    ids, values, logprobs = ids[order], values[order], logprobs[order]
    if s.temperature == 0.0:
        return int(ids[0]), float(logprobs[0])
    assert u is not None
    if s.top_k > 0:
        # The global top-k are the merged first top_k (each part sent its own top_k): exact.
        keep = min(s.top_k, ids.size)
        ids, logprobs = ids[:keep], logprobs[:keep]
        probs = np.exp(logprobs)
        if s.top_p < 1.0:
            cumulative = np.cumsum(probs) / np.sum(probs)
            cut = int(np.searchsorted(cumulative, s.top_p, side="left")) + 1
            ids, probs = ids[:cut], probs[:cut]
        probs = probs / np.sum(probs)
        pick = int(np.searchsorted(np.cumsum(probs), u, side="right"))
        i = min(pick, ids.size - 1)
        return int(ids[i]), float(logprobs[i])
    # top_k off: the walk over the whole vocabulary's order is exact over the merged prefix above
    # every incomplete part's floor.
    floor = max(p[4] for p in parts)
    exact = ids.size if floor == -np.inf else int(np.sum(values > floor))
    complete = exact == ids.size == vocabulary
    probs = np.exp(logprobs[:exact])
    # The mass of the whole vocabulary under these log-probabilities (1 up to rounding).
    total = float(np.sum(np.array([p[1] for p in parts]) * np.exp(maxes - top - log_total)))
    if s.top_p < 1.0:
        cumulative = np.cumsum(probs) / total
        cut = int(np.searchsorted(cumulative, s.top_p, side="left"))
        if cut >= exact and not complete:
            return Need(_threshold(s.top_p, vocabulary, top, log_total))
        ids, probs = ids[: cut + 1], probs[: cut + 1]
        probs = probs / np.sum(probs)
        pick = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    else:
        pick = int(np.searchsorted(np.cumsum(probs / total), u, side="right"))
        if pick >= exact and not complete:
            return Need(_threshold(u, vocabulary, top, log_total))
    i = min(pick, ids.size - 1, exact - 1)
    return int(ids[i]), float(logprobs[i])


def _threshold(c: float, vocabulary: int, top: float, log_total: float) -> float:
    """The scaled logit at probability ``(1 - c) / (2 V)``: everything above it holds the walk's
    end (module docstring)."""
    tau = (1.0 - c) / (2.0 * vocabulary)
    if tau <= 0.0:
        return -np.inf
    return top + log_total + float(np.log(tau))


def merge_rows(
    parts: Sequence[PartRows], sampling: Sequence[Sampling], uniforms: Sequence[float | None]
) -> list[tuple[int, float] | Need]:
    """Each row's (id, log-probability), or ``Need`` where its parts must send more."""
    vocabulary = sum(p.size for p in parts)
    return [
        _merge_one([p.row(r) for p in parts], s, u, vocabulary)
        for r, (s, u) in enumerate(zip(sampling, uniforms, strict=True))
    ]


def uniforms(
    sampling: Sequence[Sampling], token_index: Sequence[int], fallback: np.random.Generator
) -> list[float | None]:
    """Each row's uniform draw, as ``sampling.sample_rows`` draws it (none for greedy)."""
    return [
        None if s.temperature == 0.0 else draw_uniform(s, t, fallback)
        for s, t in zip(sampling, token_index, strict=True)
    ]


def sample_split(
    first: Sequence[PartRows],
    more: Callable[[list[int], list[float]], Sequence[PartRows]],
    sampling: Sequence[Sampling],
    token_index: Sequence[int],
    fallback: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, int]:
    """``sample_rows``'s ids and log-probabilities from the parts' first summaries, asking
    ``more(rows, thresholds)`` for the parts' summaries of those rows above those thresholds
    where a row needs them; also how many rows were asked again."""
    draws = uniforms(sampling, token_index, fallback)
    answers = merge_rows(first, sampling, draws)
    asked = 0
    for last_round in (False, True):
        pending = [r for r, a in enumerate(answers) if isinstance(a, Need)]
        if not pending:
            break
        asked += len(pending) if not last_round else 0
        thresholds = [
            -np.inf if last_round else answers[r].threshold  # type: ignore[union-attr]
            for r in pending
        ]
        again = merge_rows(
            more(pending, thresholds), [sampling[r] for r in pending], [draws[r] for r in pending]
        )
        for r, a in zip(pending, again, strict=True):
            answers[r] = a
    ids = np.zeros((len(sampling),), np.int64)
    logprobs = np.zeros((len(sampling),), np.float32)
    for r, a in enumerate(answers):
        assert not isinstance(a, Need)  # the last round sends every id: always complete
        ids[r], logprobs[r] = a
    return ids, logprobs, asked
