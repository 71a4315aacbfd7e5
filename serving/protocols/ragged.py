"""Ragged requests: rows of one request that differ in length (a TF-Serving ``instances`` list of
token rows). With length padding they are padded to the request's longest row and queued as one
request; without it they are grouped by shape, a request per group. Each row is answered cut back
to its own length. Pure numpy, above the batcher: it takes the batcher's submit function and
length padding (``Batcher.submit_lengths``, ``Batcher.length_padding``), so that
``serving.batching`` knows no ragged request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from serving.errors import InvalidInputError

if TYPE_CHECKING:
    from serving.batching.lengths import LengthPadding

__all__ = ["Row", "SubmitLengths", "group_by_shape", "split_rows", "stack_padded", "submit_rows"]

Row = dict[str, np.ndarray]  # one instance: input name -> its array, without the rows dimension

# ``Batcher.submit_lengths``: (inputs, rows, deadline, request id, each row's own length where
# the rows were padded) -> the outputs, rows first
SubmitLengths = Callable[[Row, int, float | None, str | None, np.ndarray | None], Awaitable[Row]]


def check_rows(rows: Sequence[Row]) -> list[str]:
    """The input names every row has (the same in each); a clear error otherwise."""
    if not rows:
        raise InvalidInputError("a request needs at least one row, got none")
    names = sorted(rows[0])
    if not names:
        raise InvalidInputError("a request needs at least one input array, got none")
    for i, row in enumerate(rows):
        if sorted(row) != names:
            raise InvalidInputError(f"row {i} has inputs {sorted(row)}; row 0 has {names}")
    return names


def stack_padded(rows: Sequence[Row], lengths: LengthPadding) -> tuple[Row, np.ndarray]:
    """The rows length padded to the longest of them and stacked, and each row's own length.

    Each input is one array filled with its pad value and the rows copied in: a padded copy of
    each row then a concatenation took twice the memory and a call per row (200,000 rows of
    one token padded to 512 were 400 MB of copies). Rows must agree on every dimension but the
    padded one: those are no length padding's to reconcile, so they are refused with the first
    row that differs."""
    names = check_rows(rows)
    first = rows[0]
    for name in names:
        for i, row in enumerate(rows):
            if row[name].ndim != first[name].ndim or row[name].ndim < lengths.axes.get(name, 0):
                raise InvalidInputError(
                    f"row {i} of input {name!r} has {row[name].ndim} dimension(s), row 0 has "
                    f"{first[name].ndim}: rows may differ only in their length"
                )
    padded = [(name, axis - 1) for name, axis in lengths.axes.items() if name in first]
    own = np.array([max((row[n].shape[axis] for n, axis in padded), default=0) for row in rows])
    longest = int(own.max())
    stacked: Row = {name: _stack_one(rows, name, lengths, longest) for name in names}
    return stacked, own


def _stack_one(rows: Sequence[Row], name: str, lengths: LengthPadding, longest: int) -> np.ndarray:
    """Input ``name`` of every row in one array, padded along its length axis to ``longest``."""
    axis = lengths.axes.get(name)
    row_axis = None if axis is None else axis - 1
    shape = list(rows[0][name].shape)
    if row_axis is not None:
        shape[row_axis] = longest
    dtype = np.result_type(*(row[name].dtype for row in rows))
    if row_axis is None:
        batch = np.empty((len(rows), *shape), dtype=dtype)
    else:
        batch = np.full((len(rows), *shape), lengths.pad_values[name], dtype=dtype)
    for i, row in enumerate(rows):
        array = row[name]
        own = list(array.shape)
        if row_axis is not None:
            own[row_axis] = longest
        if own != shape:
            raise InvalidInputError(
                f"row {i} of input {name!r} has shape {tuple(array.shape)}, row 0 has "
                f"{tuple(rows[0][name].shape)}: rows may differ only in their length"
            )
        batch[i][tuple(slice(0, d) for d in array.shape)] = array
    return batch


def group_by_shape(rows: Sequence[Row]) -> list[tuple[list[int], Row]]:
    """The rows grouped by their shapes (in order of first appearance): the indices of each
    group's rows, and the group stacked."""
    check_rows(rows)
    groups: dict[tuple[tuple[str, tuple[int, ...]], ...], list[int]] = {}
    for i, row in enumerate(rows):
        shape = tuple((name, tuple(row[name].shape)) for name in sorted(row))
        groups.setdefault(shape, []).append(i)
    return [
        (indices, {name: np.stack([rows[i][name] for i in indices]) for name in rows[indices[0]]})
        for indices in groups.values()
    ]


def split_rows(outputs: Row, own: np.ndarray, lengths: LengthPadding | None) -> list[Row]:
    """A request's outputs (rows first) as one dict per row, each cut back to its own length."""
    answers: list[Row] = []
    for i, length in enumerate(own):
        row = {name: array[i : i + 1] for name, array in outputs.items()}
        if lengths is not None:
            row = lengths.cut(row, int(length))
        answers.append({name: array[0] for name, array in row.items()})
    return answers


async def submit_rows(
    submit: SubmitLengths,
    lengths: LengthPadding | None,
    rows: list[Row],
    deadline: float | None = None,
    request_id: str | None = None,
) -> list[Row]:
    """A ragged request: one dict of arrays per row (no rows dimension), rows of different
    lengths, each answered cut back to its own length. With length padding (``lengths``, the
    batcher's in force) one request of the rows padded to the longest; without, one request per
    distinct shape, answered together (one failing fails the request, and the others are
    withdrawn). ``submit``: the batcher's ``submit_lengths``."""
    if lengths is not None:
        stacked, own = stack_padded(rows, lengths)
        outputs = await submit(stacked, len(rows), deadline, request_id, own)
        return split_rows(outputs, own, lengths)
    groups = group_by_shape(rows)
    # Parts of this request, not background tasks: gathered here, each raise the request's.
    tasks = [
        asyncio.ensure_future(submit(inputs, len(indices), deadline, request_id, None))
        for indices, inputs in groups
    ]
    try:
        answers = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    by_row: list[Row] = [{} for _ in rows]
    for (indices, _), outputs in zip(groups, answers, strict=True):
        for i, row in zip(indices, split_rows(outputs, np.zeros(len(indices)), None), strict=True):
            by_row[i] = row
    return by_row
