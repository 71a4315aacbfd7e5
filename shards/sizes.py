"""Bytes, counted and written for people: a dtype's item size, a tensor row's bytes, a size
in KiB/MiB/GiB. Pure Python: every layer of ``shards`` (and the server) reads these."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["format_size", "itemsize", "row_bytes"]


def itemsize(dtype: str) -> int:
    sizes = {"float64": 8, "int64": 8, "complex64": 8, "float16": 2, "bfloat16": 2, "int16": 2}
    return sizes.get(dtype, 1 if dtype in ("int8", "uint8", "bool") else 4)


def row_bytes(shape: Sequence[Any], dtype: str, sequence_length: int = 1) -> tuple[int, bool]:
    """Bytes of one row of a tensor (its shape without the batch dimension) and whether a
    dimension was unknown (counted as ``sequence_length``)."""
    dims = tuple(shape)[1:]
    unknown = any(d is None for d in dims)
    size = math.prod(sequence_length if d is None else int(d) for d in dims)
    return size * itemsize(dtype), unknown


def format_size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"
