"""Length padding: rows of different lengths share a queue and a batch, padded to the bucket of
the batch's longest row, and each request gets its outputs cut back to its own length."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from serving.batching.lengths import LengthPadding, length_buckets
from serving.errors import InvalidInputError
from tests.serving.batching.harness import LONG_MS, Harness

LENGTHS = LengthPadding(
    axes={"ids": 1}, pad_values={"ids": 0}, buckets=(8, 16, 32), output_axes={"tokens": 1}
)


class TokenModel:
    """A masked token model: pad positions (id 0) add nothing to ``total``; ``tokens`` is one
    value per position. Keeps the shape of every batch it ran."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    async def run_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = inputs["ids"]
        self.shapes.append(ids.shape)
        await asyncio.sleep(0)
        return {"total": ids.sum(axis=1, keepdims=True), "tokens": ids * 2}


def tokens(length: int, start: int = 1) -> dict[str, np.ndarray]:
    return {"ids": np.arange(start, start + length, dtype=np.int32)[None]}


def test_buckets_are_powers_of_two_up_to_the_longest_or_the_ones_allowed() -> None:
    assert length_buckets(128) == (16, 32, 64, 128)
    assert length_buckets(100) == (16, 32, 64, 100)
    assert length_buckets(8) == (8,)
    assert length_buckets(128, (64, 16, 500)) == (16, 64, 128)
    with pytest.raises(ValueError, match="integers >= 1"):
        length_buckets(128, (0,))
    assert LENGTHS.bucket(1) == 8 and LENGTHS.bucket(9) == 16 and LENGTHS.bucket(99) == 32


def test_pad_and_cut_work_along_the_padded_axis_only() -> None:
    padded = LENGTHS.pad({"ids": np.ones((2, 3), np.int32), "x": np.ones((2, 3))}, 8)
    assert padded["ids"].shape == (2, 8) and padded["ids"][:, 3:].sum() == 0
    assert padded["x"].shape == (2, 3)  # not a padded input
    cut = LENGTHS.cut({"tokens": np.ones((2, 8, 4)), "total": np.ones((2, 8))}, 3)
    assert cut["tokens"].shape == (2, 3, 4) and cut["total"].shape == (2, 8)
    assert LENGTHS.key_shape("ids", (7,)) == (-1,) and LENGTHS.key_shape("x", (7,)) == (7,)
    with pytest.raises(ValueError, match="axis and a pad value"):
        LengthPadding(axes={"ids": 1}, pad_values={}, buckets=(8,))


async def test_rows_of_different_lengths_share_one_batch_and_are_cut_back(make: Harness) -> None:
    model = TokenModel()
    batcher = await make(
        model.run_batch, lengths=LENGTHS, max_batch_size=8, batch_timeout_ms=LONG_MS
    )
    lengths = [3, 9, 17, 5]
    requests = [tokens(n, start=10 * i + 1) for i, n in enumerate(lengths)]
    pending = asyncio.gather(*(batcher.submit(r) for r in requests))
    await asyncio.sleep(0)  # all four queued
    await batcher.stop()  # the flush sends the one batch all four rows wait in
    answers = await pending

    assert model.shapes == [(4, 32)]  # one queue, padded to the bucket of the 17-token row
    for request, answer in zip(requests, answers, strict=True):
        np.testing.assert_array_equal(answer["total"], request["ids"].sum(axis=1, keepdims=True))
        np.testing.assert_array_equal(answer["tokens"], request["ids"] * 2)  # its own length
    record = make.records[0]
    assert record.positions == sum(lengths)
    assert record.padded_positions == 4 * 32 - sum(lengths)


async def test_without_length_padding_each_length_queues_apart(make: Harness) -> None:
    model = TokenModel()
    batcher = await make(model.run_batch, max_batch_size=8, batch_timeout_ms=LONG_MS)
    pending = asyncio.gather(*(batcher.submit(tokens(n)) for n in (3, 9, 3)))
    await asyncio.sleep(0)
    await batcher.stop()
    answers = await pending

    assert sorted(model.shapes) == [(1, 9), (2, 3)]
    assert [a["tokens"].shape for a in answers] == [(1, 3), (1, 9), (1, 3)]
    assert all(r.positions == 0 and r.padded_positions == 0 for r in make.records)


async def test_a_request_longer_than_the_longest_bucket_is_refused(make: Harness) -> None:
    batcher = await make(TokenModel().run_batch, lengths=LENGTHS, batch_timeout_ms=0)
    with pytest.raises(InvalidInputError, match="length 33; at most 32"):
        await batcher.submit(tokens(33))
    assert make.records == []


async def test_length_padding_changes_only_while_nothing_is_queued(make: Harness) -> None:
    batcher = await make(TokenModel().run_batch, batch_timeout_ms=LONG_MS)
    batcher.set_length_padding(LENGTHS)
    assert batcher.length_padding is LENGTHS
    pending = asyncio.ensure_future(batcher.submit(tokens(3)))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="only while no row is queued"):
        batcher.set_length_padding(None)
    await batcher.stop()
    assert (await pending)["tokens"].shape == (1, 3)


def test_stack_pads_each_part_and_repeats_the_last_real_row_for_row_padding() -> None:
    parts = [np.array([[1, 2]], np.int32), np.array([[3, 4, 5], [6, 7, 8]], np.int32)]
    batch = LENGTHS.stack("ids", parts, 4, rows=4)
    assert batch.tolist() == [[1, 2, 0, 0], [3, 4, 5, 0], [6, 7, 8, 0], [6, 7, 8, 0]]
    with pytest.raises(KeyError, match="not length padded"):
        LENGTHS.stack("x", parts, 4, rows=4)
