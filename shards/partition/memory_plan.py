"""What a stage needs on its device: weights + the activations live at its worst point + the
device's own overhead; and byte sizes written with units (``16GiB``, ``40GB``, ``512MiB``).

Pure Python (no TensorFlow): the front end parses budgets with it, and the planner reads only
the shapes and dtypes of a graph's tensors.

The activation peak of a stage over nodes ``[a, b)`` at a batch of N rows: the stage's inputs
are held for the whole call (the actor keeps the arrays it was sent); a tensor made inside the
stage lives from the node that makes it to its last reader inside the stage, or to the end of
the stage when a later stage or the model's outputs read it. The peak is the largest sum over
the nodes of the stage. A dimension unknown in the graph (a sequence length) counts as the
plan's ``sequence_length`` (``--max-sequence-length``), and the plan says so.

A layer may say what its shapes do not (``plan_row_bytes(reads, sequence_length)``, the parts
of a split layer: ``shards.split``): its outputs' bytes per row where their leading axis is not
the batch's (a routed lookup part's rows found, counted at their worst case), and the bytes it
holds inside its call (a paired part's slice of the hidden activation), live at that node only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from shards.errors import PlanError
from shards.sizes import format_size, itemsize, row_bytes

GiB = 1024**3
# A CPU stage actor before its stage loads: a Ray worker that has imported TensorFlow and Keras
# (0.60 GB for a bare `import tensorflow, keras`, issue 12) plus Ray's worker (~0.1 GB).
CPU_OVERHEAD_BYTES = 700 * 1024**2
# A GPU: the CUDA context, cuBLAS/cuDNN handles and their workspaces, and TensorFlow's
# allocator slack take 0.5-1 GiB of device memory before any weight.
GPU_OVERHEAD_BYTES = 1 * GiB
# The server's default --max-sequence-length: what a dimension unknown in the graph counts as.
DEFAULT_MAX_SEQUENCE_LENGTH = 512

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def default_overhead(gpu: bool) -> int:
    return GPU_OVERHEAD_BYTES if gpu else CPU_OVERHEAD_BYTES


def parse_bytes(value: int | str) -> int:
    """``16GiB``, ``40GB``, ``512MiB``, ``1.5GiB`` or a plain number of bytes, >= 1."""
    if isinstance(value, bool):
        raise PlanError(f"a byte size must be a number with an optional unit, got {value!r}")
    if isinstance(value, int):
        number = value
    else:
        match = _SIZE.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise PlanError(
                f"cannot read {value!r} as a byte size; write a number with an optional unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 16GiB or 40GB"
            )
        number = math.floor(float(match.group(1)) * _UNITS[unit])
    if number < 1:
        raise PlanError(f"a byte size must be >= 1 byte, got {value!r}")
    return number


def parse_budgets(value: int | str | Iterable[int | str]) -> tuple[int, ...]:
    """One budget for every stage (``16GiB``) or one per device (``16GiB,16GiB,40GiB``)."""
    parts: list[int | str]
    if isinstance(value, int | str):
        parts = (
            [p for p in str(value).split(",") if p.strip()] if isinstance(value, str) else [value]
        )
    else:
        parts = list(value)
    if not parts:
        raise PlanError(f"max_stage_bytes needs at least one budget, got {value!r}")
    return tuple(parse_bytes(p) for p in parts)


def format_budgets(budgets: Sequence[int]) -> str:
    return ",".join(str(b) for b in budgets)


@dataclass(frozen=True)
class StageNeed:
    weight_bytes: int
    activation_bytes: int
    overhead_bytes: int
    plan_batch_rows: int
    unknown_dims: bool = False
    sequence_length: int = 1

    @property
    def total(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.overhead_bytes

    def explain(self) -> str:
        return (
            f"{format_size(self.weight_bytes)} of weights ({self.weight_bytes} bytes) + "
            f"{format_size(self.activation_bytes)} of activations at batch "
            f"{self.plan_batch_rows}{self._length()} + {format_size(self.overhead_bytes)} of "
            "device overhead = "
            f"{format_size(self.total)} ({self.total} bytes)"
        )

    def _length(self) -> str:
        return f", length {self.sequence_length}" if self.unknown_dims else ""


def _served_bytes(node: Any, served_size: int | None) -> int:
    """A node's planned weight bytes, its float weights at ``served_size`` bytes when given."""
    planned = int(node.cost.param_bytes)
    op = getattr(getattr(node, "node", None), "operation", None)
    weights = list(getattr(op, "weights", ()))
    if served_size is None or planned == 0 or not weights:
        return planned
    full = served = 0
    for w in weights:
        count, dtype = math.prod(w.shape), str(w.dtype)
        full += count * itemsize(dtype)
        served += count * (served_size if dtype in ("float32", "float64") else itemsize(dtype))
    return planned * served // full if full else planned


class MemoryModel:
    """Per-stage needs over a ``shards.partition.graph.Graph`` (read through ``nodes[i].inputs``,
    ``.outputs``, ``.cost.param_bytes`` and ``output_ids``)."""

    def __init__(
        self,
        graph: Any,
        plan_batch_rows: int,
        overhead_bytes: int,
        weight_dtype: str | None = None,
        sequence_length: int = 1,
    ) -> None:
        """``weight_dtype`` (bfloat16, float16): the float weights are served in it
        (``--weight-dtype``), so they count at its size. ``sequence_length``: what a dimension
        unknown in the graph counts as (``--max-sequence-length``)."""
        if plan_batch_rows < 1:
            raise PlanError(f"max_batch_size must be an integer >= 1, got {plan_batch_rows}")
        if sequence_length < 1:
            raise PlanError(f"max_sequence_length must be an integer >= 1, got {sequence_length}")
        self.sequence_length = sequence_length
        if overhead_bytes < 0:
            raise PlanError(f"device_overhead_bytes must be >= 0, got {overhead_bytes}")
        self.plan_batch_rows = plan_batch_rows
        self.overhead_bytes = overhead_bytes
        self.weight_dtype = weight_dtype
        nodes = graph.nodes
        reduced = None if weight_dtype in (None, "float32") else itemsize(str(weight_dtype))
        self._weights = [_served_bytes(n, reduced) for n in nodes]
        self._row: dict[int, int] = {}
        self._unknown: set[int] = set()
        self._producer: dict[int, int] = {}
        self._readers: dict[int, list[int]] = {}
        self._reads: list[list[int]] = []
        self._makes: list[list[int]] = []
        # Bytes per row a node holds inside its call (a layer's plan_row_bytes).
        self._inside: list[int] = []
        for i, node in enumerate(nodes):
            self._reads.append([self._note(t) for t in node.inputs])
            self._makes.append([self._note(t) for t in node.outputs])
            self._inside.append(self._planned(node))
            for tid in self._reads[-1]:
                self._readers.setdefault(tid, []).append(i)
            for tid in self._makes[-1]:
                self._producer[tid] = i
        self._model_outputs = set(graph.output_ids)

    def _note(self, tensor: Any) -> int:
        tid = id(tensor)
        if tid not in self._row:
            size, unknown = row_bytes(tuple(tensor.shape), str(tensor.dtype), self.sequence_length)
            self._row[tid] = size
            if unknown:
                self._unknown.add(tid)
        return tid

    def _planned(self, node: Any) -> int:
        """A layer's own word on its rows (``plan_row_bytes``): its outputs' bytes per row put
        in place of their shapes'; the bytes it holds inside its call returned."""
        keras_node = getattr(node, "node", None)
        say = getattr(getattr(keras_node, "operation", None), "plan_row_bytes", None)
        if keras_node is None or say is None:
            return 0
        reads = [(tuple(t.shape), str(t.dtype)) for t in keras_node.input_tensors]
        outputs, inside = say(reads, self.sequence_length)
        unknown = any(d is None for shape, _ in reads for d in shape[1:])
        for tensor, size in zip(node.outputs, outputs or [None] * len(node.outputs), strict=True):
            if size is not None:
                self._row[id(tensor)] = int(size)
                if unknown:
                    self._unknown.add(id(tensor))
        return int(inside)

    def _needed_after(self, tid: int, end: int) -> bool:
        return tid in self._model_outputs or any(r >= end for r in self._readers.get(tid, ()))

    def activation_rows(self, start: int, end: int) -> tuple[int, bool]:
        """Peak bytes per row of the tensors live in the stage over nodes[start:end]."""
        held = {
            tid
            for i in range(start, end)
            for tid in self._reads[i]
            if self._producer.get(tid, -1) < start
        }
        unknown = bool(held & self._unknown)
        live = [0] * (end - start + 1)
        for i in range(start, end):
            for tid in self._makes[i]:
                unknown = unknown or tid in self._unknown
                if self._needed_after(tid, end):
                    last = end - 1
                else:
                    last = max((r for r in self._readers.get(tid, ()) if r < end), default=i)
                live[i - start] += self._row[tid]
                live[last - start + 1] -= self._row[tid]
            live[i - start] += self._inside[i]
            live[i - start + 1] -= self._inside[i]
        peak, running = 0, 0
        for delta in live[:-1]:
            running += delta
            peak = max(peak, running)
        return sum(self._row[t] for t in held) + peak, unknown

    def need(self, start: int, end: int) -> StageNeed:
        rows, unknown = self.activation_rows(start, end)
        return StageNeed(
            weight_bytes=sum(self._weights[start:end]),
            activation_bytes=rows * self.plan_batch_rows,
            overhead_bytes=self.overhead_bytes,
            plan_batch_rows=self.plan_batch_rows,
            unknown_dims=unknown,
            sequence_length=self.sequence_length,
        )

    def crossing_bytes_per_row(self, start: int, end: int) -> int:
        """Bytes per row the stage sends on: what later stages or the model's outputs read."""
        return sum(
            self._row[tid]
            for i in range(start, end)
            for tid in self._makes[i]
            if self._needed_after(tid, end)
        )
