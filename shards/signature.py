"""Tensor and model signatures: names, per-row shapes and dtypes, as plain data (numpy only).

A ``TensorSpec.shape`` is the shape of ONE row: the batch dimension is left out. ``None`` marks a
dimension of any size (for instance a sequence length). ``TensorSpec.pad_value`` is the value whose
positions the model masks along that dimension (found when the model was cut,
``shards.partition.length_masks``): rows padded with it answer as they would unpadded.
``TensorSpec.max_length`` is the longest that dimension may be, where the model bounds it (a
position embedding of so many rows, ``shards.partition.length_bound``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

Shape = tuple[int | None, ...]
PadValue = int | float | bool


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: Shape
    dtype: str
    # None: the model does not mask this input (a manifest written before pad values has none).
    pad_value: PadValue | None = None
    # None: nothing in the model bounds its unknown dimension (or an older manifest).
    max_length: int | None = None

    @property
    def np_dtype(self) -> np.dtype[Any]:
        return np.dtype(self.dtype)

    def describe(self) -> str:
        dims = ", ".join(["n", *("?" if d is None else str(d) for d in self.shape)])
        return f"({dims}) {self.dtype}"

    def matches_row_shape(self, row_shape: tuple[int, ...]) -> bool:
        if len(row_shape) != len(self.shape):
            return False
        return all(
            want is None or want == got for want, got in zip(self.shape, row_shape, strict=True)
        )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.pad_value is not None:
            data["pad_value"] = self.pad_value
        if self.max_length is not None:
            data["max_length"] = self.max_length
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorSpec:
        shape = tuple(None if d is None else int(d) for d in data["shape"])
        pad_value = data.get("pad_value")
        if pad_value is not None and not isinstance(pad_value, int | float | bool):
            raise ValueError(
                f"tensor {data['name']!r} has pad_value {pad_value!r}; expected a number or a "
                "boolean (or none); partition the model again"
            )
        max_length = data.get("max_length")
        if max_length is not None and (
            not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1
        ):
            raise ValueError(
                f"tensor {data['name']!r} has max_length {max_length!r}; expected an integer "
                ">= 1 (or none); partition the model again"
            )
        return cls(
            name=str(data["name"]),
            shape=shape,
            dtype=str(data["dtype"]),
            pad_value=pad_value,
            max_length=max_length,
        )


@dataclass(frozen=True)
class ModelSignature:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    @cached_property  # asked twice per request (serving.settings.lengths.served_max_length)
    def max_length(self) -> int | None:
        """The longest length the model takes along its unknown dimensions: the shortest of
        its inputs' bounds (a request's inputs share one length); ``None`` where none has one."""
        return min((t.max_length for t in self.inputs if t.max_length is not None), default=None)

    def too_long(self, inputs: Mapping[str, np.ndarray], max_length: int) -> str | None:
        """Why ``inputs`` are refused: a dimension the model leaves unknown (a sequence length)
        longer than ``max_length``; ``None`` when none is."""
        for spec in self.inputs:
            array = inputs.get(spec.name)
            for axis, want in enumerate(spec.shape, start=1):
                if want is None and array is not None and array.shape[axis] > max_length:
                    shape = ", ".join(str(d) for d in array.shape)
                    return (
                        f"input {spec.name!r} has shape ({shape}): length {array.shape[axis]} "
                        f"in dimension {axis} is over max_sequence_length={max_length}, the "
                        f"longest this server takes; send at most {max_length}"
                    )
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelSignature:
        return cls(
            name=str(data["name"]),
            inputs=tuple(TensorSpec.from_json(t) for t in data["inputs"]),
            outputs=tuple(TensorSpec.from_json(t) for t in data["outputs"]),
        )
