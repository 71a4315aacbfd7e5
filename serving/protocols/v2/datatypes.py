"""The protocol's tensor datatypes and their numpy dtypes (both transports use this table).

BF16 has no numpy dtype of its own; its bytes are 16-bit words, read with ``ml_dtypes`` where a
model takes bfloat16. BYTES (strings) is not served: no demo or Keras numeric model takes it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# datatype -> numpy dtype string (little-endian where it matters: the wire format is)
TO_NUMPY: dict[str, str] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "INT8": "int8",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
}
BINARY_ONLY = frozenset({"BF16"})
DATATYPES = (*TO_NUMPY, *sorted(BINARY_ONLY))


def datatype_of(dtype: str | np.dtype[Any]) -> str:
    """The protocol's name for a model dtype (``float32`` -> ``FP32``, ``bfloat16`` -> ``BF16``)."""
    name = np.dtype(dtype).name if str(dtype) != "bfloat16" else "bfloat16"
    if name == "bfloat16":
        return "BF16"
    for datatype, np_name in TO_NUMPY.items():
        if np.dtype(np_name).name == name:
            return datatype
    raise ValueError(f"dtype {name!r} has no Open Inference Protocol datatype")


def itemsize(datatype: str) -> int:
    if datatype == "BF16":
        return 2
    return int(np.dtype(TO_NUMPY[datatype]).itemsize)
