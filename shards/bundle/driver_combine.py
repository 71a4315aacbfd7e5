"""The combine of a split layer whose output is a model output, done by the driver with numpy.

Where a split layer's combine would be the last stage of the pipeline (a wide output ``Dense``, a
tied embedding's logits), a TensorFlow actor that only concatenates arrays would cost a process
(~650 MB), a hop through the object store and a place in the pipeline. The driver awaits the
parts' outputs instead (the replica collects the model's outputs anyway) and joins them here:
a concatenation (columns; then a ReversibleEmbedding's ``logit_soft_cap``) or a sum (a table's
rows: every element is one part's value plus zeros, so the sum is exact). A combine that applies
a non-linear activation stays a stage of its own, in TensorFlow, so that the answer is the one
Keras computes. Pure numpy: the server process never imports TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DriverCombine:
    """A model output ``output`` made from the tensors ``parts`` (the parts' outputs, in
    order): ``how`` is ``concat`` (along ``axis``) or ``add``."""

    output: str
    how: str
    parts: tuple[str, ...]
    axis: int = -1
    soft_cap: float | None = None

    def __post_init__(self) -> None:
        if self.how not in ("concat", "add"):
            raise ValueError(f"a driver combine is 'concat' or 'add', got {self.how!r}")

    def apply(self, made: Mapping[str, np.ndarray]) -> np.ndarray:
        values = [np.asarray(made[name]) for name in self.parts]
        if self.how == "add":
            joined = values[0].copy()
            for value in values[1:]:
                joined += value
            return joined
        joined = np.concatenate(values, axis=self.axis)
        if self.soft_cap is not None:
            cap = np.asarray(self.soft_cap, dtype=joined.dtype)
            joined = np.tanh(joined / cap) * cap
        return joined

    def to_json(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "how": self.how,
            "parts": list(self.parts),
            "axis": self.axis,
            "soft_cap": self.soft_cap,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DriverCombine:
        cap = data.get("soft_cap")
        return cls(
            output=str(data["output"]),
            how=str(data["how"]),
            parts=tuple(str(p) for p in data["parts"]),
            axis=int(data.get("axis", -1)),
            soft_cap=None if cap is None else float(cap),
        )


def combine_outputs(
    combines: tuple[DriverCombine, ...], made: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Each driver-combined output from the parts' outputs in ``made``."""
    return {c.output: c.apply(made) for c in combines}
