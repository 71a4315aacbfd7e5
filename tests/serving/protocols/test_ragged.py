"""A ragged request (rows of different lengths) on a batcher: padded to its longest row into one
array per input, allocated once (issue 27, item 4: a padded copy of each row, then their
concatenation, held twice the batch), or one request per length without length padding."""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator

import numpy as np
import pytest

from serving.batching.lengths import LengthPadding
from serving.errors import InvalidInputError
from serving.protocols.ragged import stack_padded, submit_rows
from tests.serving.batching.harness import Harness
from tests.serving.batching.test_lengths import LENGTHS as TOKEN_LENGTHS
from tests.serving.batching.test_lengths import TokenModel

LENGTHS = LengthPadding(
    axes={"ids": 1, "mask": 2}, pad_values={"ids": 0, "mask": -1}, buckets=(512,)
)


@pytest.fixture
async def make() -> AsyncIterator[Harness]:
    """Batchers as the batching tests start them (``harness.py``), stopped after the test."""
    harness = Harness()
    yield harness
    for batcher in harness.batchers:
        await batcher.stop(drain=False)


def test_rows_are_padded_into_one_array_of_the_longest() -> None:
    rows = [
        {"ids": np.arange(1, n + 1, dtype=np.int32), "mask": np.ones((2, n), np.int8)}
        for n in (3, 1, 5)
    ]
    stacked, own = stack_padded(rows, LENGTHS)
    assert own.tolist() == [3, 1, 5]
    np.testing.assert_array_equal(
        stacked["ids"], [[1, 2, 3, 0, 0], [1, 0, 0, 0, 0], [1, 2, 3, 4, 5]]
    )
    assert stacked["mask"].shape == (3, 2, 5) and stacked["mask"].dtype == np.int8
    assert stacked["mask"][1].tolist() == [[1, -1, -1, -1, -1]] * 2


def test_padding_many_rows_allocates_the_batch_once() -> None:
    rows = [{"ids": np.ones(512 if i == 0 else 1, np.int32)} for i in range(2000)]
    batch_bytes = 2000 * 512 * 4
    tracemalloc.start()
    try:
        stacked, _ = stack_padded(rows, LENGTHS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert stacked["ids"].nbytes == batch_bytes
    assert peak < 1.25 * batch_bytes  # a padded copy per row, then concatenated: 2x


def test_rows_that_differ_in_another_dimension_are_refused_by_index() -> None:
    rows = [{"ids": np.ones(3, np.int32), "mask": np.ones((2, 3), np.int8)}] * 2
    rows.append({"ids": np.ones(3, np.int32), "mask": np.ones((4, 3), np.int8)})
    with pytest.raises(InvalidInputError) as refused:
        stack_padded(rows, LENGTHS)
    assert refused.value.message == (
        "row 2 of input 'mask' has shape (4, 3), row 0 has (2, 3): rows may differ only in "
        "their length"
    )


async def test_a_ragged_request_is_one_request_padded_to_its_longest_row(make: Harness) -> None:
    model = TokenModel()
    batcher = await make(
        model.run_batch,
        lengths=TOKEN_LENGTHS,
        max_batch_size=8,
        batch_timeout_ms=0,
        pad_batches=False,
    )
    rows = [{"ids": np.arange(1, n + 1, dtype=np.int32)} for n in (2, 11, 6)]
    answers = await submit_rows(batcher.submit_lengths, batcher.length_padding, rows)

    assert model.shapes == [(3, 16)]
    for row, answer in zip(rows, answers, strict=True):
        assert answer["total"].tolist() == [row["ids"].sum()]
        np.testing.assert_array_equal(answer["tokens"], row["ids"] * 2)
    assert make.records[0].positions == 19


async def test_a_ragged_request_without_length_padding_goes_as_one_request_per_length(
    make: Harness,
) -> None:
    model = TokenModel()
    batcher = await make(model.run_batch, max_batch_size=8, batch_timeout_ms=0, pad_batches=False)
    rows = [{"ids": np.full(n, n, dtype=np.int32)} for n in (4, 2, 4)]
    answers = await submit_rows(batcher.submit_lengths, batcher.length_padding, rows)

    assert sorted(model.shapes) == [(1, 2), (2, 4)]
    assert [a["tokens"].tolist() for a in answers] == [[8] * 4, [4] * 2, [8] * 4]


async def test_rows_that_differ_in_more_than_their_length_are_refused(make: Harness) -> None:
    batcher = await make(TokenModel().run_batch, lengths=TOKEN_LENGTHS, batch_timeout_ms=0)
    rows = [{"ids": np.ones(3, np.int32)}, {"ids": np.ones((3, 2), np.int32)}]
    with pytest.raises(InvalidInputError, match="row 1 of input 'ids' has 2 dimension"):
        await submit_rows(batcher.submit_lengths, batcher.length_padding, rows)
    with pytest.raises(InvalidInputError, match="row 1 has inputs"):
        await submit_rows(
            batcher.submit_lengths,
            batcher.length_padding,
            [{"ids": np.ones(3, np.int32)}, {"x": np.ones(3, np.int32)}],
        )
