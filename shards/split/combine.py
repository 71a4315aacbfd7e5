"""The combine of a split layer whose output is a model output, done by the driver with numpy.

Where a split layer's combine would be the last stage of the pipeline (a wide output ``Dense``, a
tied embedding's logits), a TensorFlow actor that only concatenates arrays would cost a process
(~650 MB), a hop through the object store and a place in the pipeline. The driver awaits the
parts' outputs instead (the replica collects the model's outputs anyway) and joins them here:
a concatenation (columns; then a ReversibleEmbedding's ``logit_soft_cap``) or a sum (a table's
rows: every element is one part's value plus zeros, so the sum is exact). A combine that applies
a non-linear activation stays a stage of its own, in TensorFlow, so that the answer is the one
Keras computes. Pure numpy: the server process never imports TensorFlow.

What a join costs the front end is planned like a stage's memory: each combined output, a batch
of ``max_batch_size`` rows at the served sequence length (``join_bytes``; the parts stay in Ray's
object store, read in place, and the soft cap works in place). A version whose join would be
over the front end's budget is refused at load, saying what would fit (``check_join_budget``).
The replica joins on a worker thread (GPT-2's logits at 32 rows x 1024 tokens are 6.6 GB: the
event loop would stop for seconds), one join at a time in the process (``_JOIN_LOCK``), so that
the budget is what a join may hold, not that times the batches in flight.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shards.errors import PlanError
from shards.signature import ModelSignature
from shards.sizes import format_size

_JOIN_LOCK = threading.Lock()


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
            # In place: tanh(x / cap) * cap as three new arrays held three times the output.
            cap = np.asarray(self.soft_cap, dtype=joined.dtype)
            np.divide(joined, cap, out=joined)
            np.tanh(joined, out=joined)
            joined *= cap
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
    """Each driver-combined output from the parts' outputs in ``made`` (one call at a time in
    the process: see the module's docstring)."""
    with _JOIN_LOCK:
        return {c.output: c.apply(made) for c in combines}


def join_row_bytes(
    combines: tuple[DriverCombine, ...], signature: ModelSignature, sequence_length: int
) -> int:
    """Bytes the front end's joins allocate per row of a batch: each combined output's row, an
    unknown dimension counted as ``sequence_length``."""
    specs = {t.name: t for t in signature.outputs}
    total = 0
    for combine in combines:
        spec = specs.get(combine.output)
        if spec is None:
            continue
        dims = (sequence_length if d is None else int(d) for d in spec.shape)
        total += math.prod(dims) * np.dtype(spec.dtype).itemsize
    return total


def join_bytes(
    combines: tuple[DriverCombine, ...],
    signature: ModelSignature,
    rows: int,
    sequence_length: int,
) -> int:
    """What the front end's joins of one batch of ``rows`` rows allocate (``join_row_bytes``)."""
    return rows * join_row_bytes(combines, signature, sequence_length)


def check_join_budget(
    combines: tuple[DriverCombine, ...],
    signature: ModelSignature,
    rows: int,
    sequence_length: int,
    budget: int,
) -> None:
    """A ``PlanError`` naming the way out where a batch of ``rows`` rows' joins would take more
    than ``budget`` bytes of the front end's memory."""
    per_row = join_row_bytes(combines, signature, sequence_length)
    total = rows * per_row
    if total <= budget:
        return
    outputs = ", ".join(repr(c.output) for c in combines)
    unknown = any(
        d is None
        for t in signature.outputs
        if t.name in {c.output for c in combines}
        for d in t.shape
    )
    length = f" and length {sequence_length}" if unknown else ""
    fit = budget // per_row
    lower = f"lower max_batch_size to {fit}" if fit >= 1 else "even one row is over it"
    shorter = " or max_sequence_length" if unknown else ""
    raise PlanError(
        f"the front end joins the split output {outputs} of each batch: at max_batch_size "
        f"{rows}{length} that is {format_size(total)} ({format_size(per_row)} a row), over "
        f"driver_join_max_bytes={format_size(budget)}; {lower}{shorter}, or raise "
        "driver_join_max_bytes where the front end's machine has the memory"
    )
