"""Length padding: rows of different lengths (token counts) share a batch.

A model input whose one per-row dimension is unknown (a sequence length) may be *length padded*:
the rows of a batch are padded along that dimension, with the input's pad value, up to the
smallest length bucket that holds the batch's longest row. The rows then stack, so requests of
8 and 63 tokens join one queue and one batch instead of a queue per length. An output whose
dimension follows the padded length (found at warm-up) is cut back to each request's own length.

Whether padding is safe for a model (it masks the pad positions) is the server's question, asked
at warm-up (``serving.version.length_check``); this module only does the padding it is given.
"Padding" without "length" is the row-count padding of a batch (``BatchSettings.pad_batches``).
Pure numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["LengthPadding", "length_buckets"]


def length_buckets(max_length: int, allowed: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The lengths a batch is padded to, sorted, the last ``max_length``: ``allowed`` (those
    not over ``max_length``), or powers of two from 16 below it."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if allowed:
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in allowed):
            raise ValueError(f"allowed lengths must be integers >= 1, got {allowed!r}")
        chosen = {n for n in allowed if n <= max_length}
    else:
        chosen = set()
        n = 16
        while n < max_length:
            chosen.add(n)
            n *= 2
    chosen.add(max_length)
    return tuple(sorted(chosen))


@dataclass(frozen=True)
class LengthPadding:
    """Which inputs are length padded, along which axis, with what; the buckets; and which
    outputs follow the padded length.

    ``axes``: padded input -> the array axis (>= 1; 0 is the rows) of unknown length.
    ``pad_values``: padded input -> the value pad positions get (0 for token ids, False / 0 for
    a padding mask). Every padded input of a request shares one length: its longest.
    ``output_axes``: output -> the array axis that equals the padded length (cut back per request).
    """

    axes: Mapping[str, int]
    pad_values: Mapping[str, float | int | bool]
    buckets: tuple[int, ...]
    output_axes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.axes:
            raise ValueError("length padding needs at least one padded input")
        if set(self.axes) != set(self.pad_values):
            raise ValueError(
                f"every padded input needs an axis and a pad value: axes for "
                f"{sorted(self.axes)}, pad values for {sorted(self.pad_values)}"
            )
        if any(axis < 1 for axis in self.axes.values()):
            raise ValueError(f"a padded axis is a row axis (>= 1), got {dict(self.axes)}")
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"buckets must be sorted distinct lengths, got {self.buckets!r}")

    @property
    def max_length(self) -> int:
        return self.buckets[-1]

    def bucket(self, length: int) -> int:
        """The smallest bucket that holds ``length`` (the longest, when none does)."""
        for size in self.buckets:
            if size >= length:
                return size
        return self.buckets[-1]

    def length_of(self, inputs: Mapping[str, np.ndarray]) -> int:
        """A request's length: the longest of its padded inputs along their axes."""
        return max(inputs[name].shape[axis] for name, axis in self.axes.items() if name in inputs)

    def key_shape(self, name: str, row_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The per-row shape rows queue under: the padded axis left out (-1), so that rows of
        any length share a queue."""
        axis = self.axes.get(name)
        if axis is None or axis - 1 >= len(row_shape):
            return row_shape
        return (*row_shape[: axis - 1], -1, *row_shape[axis:])

    def pad(self, inputs: Mapping[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
        """Every padded input padded with its pad value along its axis up to ``length``."""
        return {name: self.pad_one(name, array, length) for name, array in inputs.items()}

    def pad_one(self, name: str, array: np.ndarray, length: int) -> np.ndarray:
        """``array`` (input ``name``) padded along its axis up to ``length``; as it is when the
        input is not padded or is that long already."""
        axis = self.axes.get(name)
        if axis is None or array.shape[axis] >= length:
            return array
        widths = [(0, 0)] * array.ndim
        widths[axis] = (0, length - array.shape[axis])
        fill = np.array(self.pad_values[name], dtype=array.dtype)
        return np.pad(array, widths, constant_values=fill)

    def stack(self, name: str, parts: list[np.ndarray], length: int, rows: int) -> np.ndarray:
        """``parts`` of input ``name`` (rows first) stacked into ``rows`` rows, each length padded
        to ``length``; rows past the parts repeat the last real row (the batch's row-count
        padding). One array filled with the pad value and the parts copied in: ``np.pad`` per
        part cost ~45 us each, most of a request's time in the batcher."""
        axis = self.axes.get(name)
        if axis is None:
            raise KeyError(f"input {name!r} is not length padded")
        first = parts[0]
        shape = list(first.shape)
        shape[0], shape[axis] = rows, length
        batch = np.full(shape, self.pad_values[name], dtype=first.dtype)
        index: list[slice] = [slice(None)] * first.ndim
        offset = 0
        for part in parts:
            index[0] = slice(offset, offset + len(part))
            index[axis] = slice(0, part.shape[axis])
            batch[tuple(index)] = part
            offset += len(part)
        if offset < rows:
            batch[offset:] = batch[offset - 1 : offset]
        return batch

    def cut(self, outputs: Mapping[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
        """The outputs that follow the padded length cut back to ``length``; the rest as they
        are."""
        cut: dict[str, np.ndarray] = {}
        for name, array in outputs.items():
            axis = self.output_axes.get(name)
            if axis is None or axis >= array.ndim or array.shape[axis] <= length:
                cut[name] = array
                continue
            index = [slice(None)] * array.ndim
            index[axis] = slice(0, length)
            cut[name] = array[tuple(index)]
        return cut
