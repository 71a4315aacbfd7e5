"""Open Inference Protocol tensors to numpy arrays and back, checked against the model signature.

Transport-neutral: the HTTP routes hand over a JSON ``data`` list or the bytes that follow the
JSON header, the gRPC service a ``raw_input_contents`` entry or a typed ``contents`` list.
Raw bytes become an array with ``np.frombuffer`` (a read-only view of the request's bytes: no
copy and no Python numbers); a JSON list goes through ``np.asarray`` once and is checked the way
``/predict``'s rows are. Every check names the input, what was sent and what the model expects.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving.errors import InvalidInputError
from serving.protocols.json_strings import holds_string
from serving.protocols.limits import DEFAULT_LIMITS, RequestLimits
from serving.protocols.v2.datatypes import BINARY_ONLY, DATATYPES, TO_NUMPY, datatype_of
from serving.quoting import quote
from shards.signature import TensorSpec

Raw = bytes | bytearray | memoryview


@functools.lru_cache(maxsize=32)
def numpy_dtype(datatype: str) -> np.dtype[Any]:
    """The little-endian numpy dtype of a datatype (``BF16``: ``ml_dtypes.bfloat16``)."""
    if datatype == "BF16":
        import ml_dtypes  # a dependency of Keras; only bfloat16 models need it here

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(TO_NUMPY[datatype])


@functools.lru_cache(maxsize=64)
def _datatype(dtype: str) -> str:
    return datatype_of(dtype)


def spec_datatype(spec: TensorSpec) -> str:
    """The datatype of a model tensor, cached (``np.dtype.name`` costs microseconds a call)."""
    return _datatype(spec.dtype)


def wire_shape(spec: TensorSpec) -> list[int]:
    """The protocol's shape of a tensor: -1 for the batch dimension and each free dimension."""
    return [-1, *(-1 if d is None else d for d in spec.shape)]


def tensor_metadata(spec: TensorSpec) -> dict[str, Any]:
    """A model metadata ``$metadata_tensor``: name, datatype, shape with -1 for the batch."""
    return {"name": spec.name, "datatype": spec_datatype(spec), "shape": wire_shape(spec)}


def tensor_config(spec: TensorSpec) -> dict[str, Any]:
    """A Triton model-config ``input``/``output`` entry: ``dims`` leave out the batch dimension."""
    datatype = spec_datatype(spec)
    return {
        "name": spec.name,
        "data_type": f"TYPE_{'STRING' if datatype == 'BYTES' else datatype}",
        "dims": wire_shape(spec)[1:],
    }


def decode_tensor(
    name: str,
    datatype: Any,
    shape: Any,
    data: Raw | list[Any],
    spec: TensorSpec,
    maybe_bool: bool = False,
    limits: RequestLimits = DEFAULT_LIMITS,
    maybe_str: bool = False,
) -> np.ndarray:
    """The array of one request input; ``shape``'s first dimension is its rows.

    ``data`` is the tensor's raw little-endian bytes, or its elements as a (flat or nested) list;
    ``maybe_bool``: the list came from JSON that holds true or false somewhere; ``maybe_str``:
    from JSON that may hold a string in its data (``serving.protocols.json_strings``). The
    shape is held to ``limits`` before anything is shaped by it.
    """
    where = f"input {quote(name)}"
    check_datatype(where, datatype, spec)
    dims = check_shape(where, shape, spec, limits)
    count = math.prod(dims)
    if isinstance(data, Raw):
        return _from_raw(where, datatype, dims, count, data, spec)
    if datatype in BINARY_ONLY:
        raise InvalidInputError(
            f"{where} is {datatype}, which JSON cannot carry; send it as binary data "
            '(parameters "binary_data_size" and the Inference-Header-Content-Length header)'
        )
    if maybe_str and holds_string(data):
        # before np.asarray: N strings are an array of N times the longest
        raise InvalidInputError(f"{where} holds strings; expected {datatype} values")
    return _from_list(where, datatype, dims, count, data, spec, maybe_bool)


def check_datatype(where: str, datatype: Any, spec: TensorSpec) -> None:
    expected = spec_datatype(spec)
    if datatype not in DATATYPES:
        raise InvalidInputError(
            f"{where} has datatype {quote(datatype)}, which is not a datatype of the protocol; "
            f"the model expects {expected}"
        )
    if datatype != expected:
        raise InvalidInputError(f"{where} has datatype {datatype}; the model expects {expected}")


def check_shape(
    where: str, shape: Any, spec: TensorSpec, limits: RequestLimits = DEFAULT_LIMITS
) -> tuple[int, ...]:
    """The declared shape as a tuple: the model's row shape, at least one row, every dimension
    within ``limits`` (so that their product, the element count, is bounded too)."""
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise InvalidInputError(
            f"{where} has shape {quote(shape)}; a shape is a list of integers >= 0, expected "
            f"{wire_shape(spec)}"
        )
    dims = tuple(shape)
    # A fixed row shape (the usual case) is one tuple comparison.
    if not dims or (dims[1:] != spec.shape and not spec.matches_row_shape(dims[1:])):
        raise InvalidInputError(
            f"{where} has shape {quote(shape)}; the model expects {wire_shape(spec)} (the first "
            "dimension is rows)"
        )
    if shape[0] < 1:
        raise InvalidInputError(f"{where} has shape {shape}: no rows; send at least one")
    limits.check_dims(where, dims, spec)
    return dims


def _from_raw(
    where: str, datatype: str, dims: tuple[int, ...], count: int, data: Raw, spec: TensorSpec
) -> np.ndarray:
    dtype = numpy_dtype(datatype)
    size = memoryview(data).nbytes
    need = count * dtype.itemsize
    if size != need:
        raise InvalidInputError(
            f"{where} has {size} bytes of data; shape {list(dims)} of {datatype} needs "
            f"{need} bytes ({count} x {dtype.itemsize})"
        )
    arr = np.frombuffer(data, dtype=dtype).reshape(dims)
    if datatype == "BOOL" and count and arr.view(np.uint8).max() > 1:
        raise InvalidInputError(f"{where} is BOOL but holds bytes other than 0 and 1")
    if arr.dtype != spec.np_dtype:  # only on a big-endian host: the wire is little-endian
        arr = arr.astype(spec.np_dtype)
    return arr


def _from_list(
    where: str,
    datatype: str,
    dims: tuple[int, ...],
    count: int,
    data: Any,
    spec: TensorSpec,
    maybe_bool: bool,
) -> np.ndarray:
    if not isinstance(data, list):
        raise InvalidInputError(
            f'{where} has "data" of type {type(data).__name__}; expected a list of {count} '
            f"{datatype} values (flat or nested, row-major)"
        )
    try:
        arr = np.asarray(data)
    except ValueError:
        raise InvalidInputError(
            f'{where} has ragged nested "data"; expected {count} values'
        ) from None
    kind, want = arr.dtype.kind, spec.np_dtype.kind
    if kind == "O":
        raise InvalidInputError(f"{where} holds null, non-numbers or out-of-range integers")
    if kind in "US":
        raise InvalidInputError(f"{where} holds strings; expected {datatype} values")
    if want == "b" and kind != "b" and arr.size:
        raise InvalidInputError(f"{where} is BOOL; its data must be true/false")
    # numpy reads [0.5, true] as [0.5, 1.0]
    if want != "b" and (kind == "b" or (maybe_bool and _holds_bool(data))):
        raise InvalidInputError(f"{where} holds booleans; expected {datatype} values")
    if want in "iu" and kind == "f":
        arr = _exact_integers(where, datatype, data, spec)
    if arr.size != count:
        raise InvalidInputError(f"{where} has {arr.size} values; shape {list(dims)} holds {count}")
    if want in "iu" and arr.size:
        info = np.iinfo(spec.np_dtype)
        if arr.min() < info.min or arr.max() > info.max:
            raise InvalidInputError(f"{where} holds values outside the range of {datatype}")
    return np.ascontiguousarray(arr.reshape(dims), dtype=spec.np_dtype)


def _holds_bool(value: Any) -> bool:
    if isinstance(value, list):
        return any(_holds_bool(v) for v in value)
    return isinstance(value, bool)


def _exact_integers(where: str, datatype: str, data: list[Any], spec: TensorSpec) -> np.ndarray:
    """Integers that numpy read as floats: a mix past int64 (``[-1, 2**63]``), or non-integers."""
    values = np.asarray(data, dtype=object)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values.flat):
        raise InvalidInputError(f"{where} holds non-integers; expected {datatype} values")
    try:
        return values.astype(spec.np_dtype)
    except OverflowError:
        raise InvalidInputError(f"{where} holds values outside the range of {datatype}") from None


@dataclass(frozen=True)
class OutputTensor:
    """One response output: ``array`` is C-contiguous and little-endian, of ``datatype``."""

    name: str
    datatype: str
    array: np.ndarray

    @property
    def shape(self) -> list[int]:
        return list(self.array.shape)

    def buffer(self) -> memoryview:
        """The tensor's bytes, a zero-copy view (``bytes(...)`` of it makes the copy)."""
        return self.array.reshape(-1).view(np.uint8).data

    def flat(self) -> np.ndarray:
        """The elements in row-major order, for JSON ``data`` (orjson serializes numpy)."""
        if self.datatype in BINARY_ONLY:
            raise InvalidInputError(
                f"output {self.name!r} is {self.datatype}, which JSON cannot carry; ask for it "
                'as binary data (output parameter "binary_data": true)'
            )
        return self.array.reshape(-1)


def encode_tensor(name: str, array: np.ndarray, spec: TensorSpec) -> OutputTensor:
    """A model output as the protocol's datatype, in the byte layout the wire wants."""
    datatype = spec_datatype(spec)
    return OutputTensor(name, datatype, np.ascontiguousarray(array, dtype=numpy_dtype(datatype)))
