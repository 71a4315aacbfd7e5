"""A ragged request's rows padded to its longest row: into one array per input, allocated once
(issue 27, item 4: a padded copy of each row, then their concatenation, held twice the batch)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from serving.batching.lengths import LengthPadding
from serving.batching.ragged import stack_padded
from serving.errors import InvalidInputError

LENGTHS = LengthPadding(
    axes={"ids": 1, "mask": 2}, pad_values={"ids": 0, "mask": -1}, buckets=(512,)
)


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
