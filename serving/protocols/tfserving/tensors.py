"""TensorFlow's ``TensorProto`` to numpy arrays and back, checked against the model signature,
and the signature as a ``SignatureDef`` (what ``GetModelMetadata`` describes).

A tensor's elements come either as ``tensor_content`` (the little-endian bytes in row-major
order: what ``tf.make_tensor_proto`` writes for every numeric array, read here with
``np.frombuffer``, no copy and no Python numbers), or in the typed field of its dtype
(``float_val``, ``int_val``, ...; ``half_val`` holds ``DT_HALF`` and ``DT_BFLOAT16`` as their
16-bit patterns, as TensorFlow packs them). One typed value fills the whole shape, as
TensorFlow reads it. A tensor is rectangular: its shape is its ``tensor_shape``, rows first.

A numeric dtype other than the model's is converted where nothing is lost in meaning (any
number to a float model; integers to an integer model, within its range); strings, booleans to
a numeric model, and fractions to an integer model are refused naming the input and the dtype to
send. Every refusal names the input, what was sent and what the model takes.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from serving.errors import InvalidInputError
from serving.protocols.limits import RequestLimits
from serving.protocols.tfserving.proto import meta_graph_pb2, tensor_pb2, types_pb2
from shards.signature import ModelSignature, TensorSpec

__all__ = ["decode_tensor", "encode_tensor", "signature_def"]

_DT = types_pb2.DataType
# DataType -> (numpy dtype name, the typed field that carries it)
_NUMERIC: dict[types_pb2.DataType, tuple[str, str]] = {
    _DT.DT_FLOAT: ("float32", "float_val"),
    _DT.DT_DOUBLE: ("float64", "double_val"),
    _DT.DT_HALF: ("float16", "half_val"),
    _DT.DT_BFLOAT16: ("bfloat16", "half_val"),
    _DT.DT_INT8: ("int8", "int_val"),
    _DT.DT_INT16: ("int16", "int_val"),
    _DT.DT_INT32: ("int32", "int_val"),
    _DT.DT_INT64: ("int64", "int64_val"),
    _DT.DT_UINT8: ("uint8", "int_val"),
    _DT.DT_UINT16: ("uint16", "int_val"),
    _DT.DT_UINT32: ("uint32", "uint32_val"),
    _DT.DT_UINT64: ("uint64", "uint64_val"),
    _DT.DT_BOOL: ("bool", "bool_val"),
}
_BY_NAME = {name: dt for dt, (name, _) in _NUMERIC.items()}
_TYPED_FIELDS = frozenset(field for _, field in _NUMERIC.values()) | {
    "string_val",
    "scomplex_val",
    "dcomplex_val",
    "resource_handle_val",
    "variant_val",
}


@functools.lru_cache(maxsize=32)
def _np_dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        import ml_dtypes  # a dependency of Keras; only bfloat16 tensors need it here

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name).newbyteorder("<")


def dtype_name(dtype: int) -> str:
    """``DT_FLOAT`` for 1: the name a client's code spells."""
    try:
        return str(_DT.Name(dtype))
    except ValueError:
        return f"DataType {dtype}"


def data_type(np_dtype: np.dtype[Any]) -> types_pb2.DataType:
    """The ``DataType`` of a numpy dtype (``DT_INVALID`` for one TensorFlow has no name for)."""
    return _BY_NAME.get(np_dtype.name, _DT.DT_INVALID)


def decode_tensor(
    name: str, tensor: tensor_pb2.TensorProto, spec: TensorSpec, limits: RequestLimits
) -> np.ndarray:
    """Input ``name``'s array, in the model's dtype; its shape held to ``spec`` and ``limits``
    (rows, unknown lengths) before its elements are read."""
    where = f"input {name!r}"
    dims = _dims(where, tensor, spec, limits)
    known = _NUMERIC.get(tensor.dtype)
    if known is None:
        raise InvalidInputError(
            f"{where} is {dtype_name(tensor.dtype)}; the model takes {spec.describe()}: send "
            f"it as {dtype_name(data_type(spec.np_dtype))}"
        )
    sent = _np_dtype(known[0])
    count = math.prod(dims)
    content = tensor.tensor_content
    if content:
        typed = [f.name for f, _ in tensor.ListFields() if f.name in _TYPED_FIELDS]
        if typed:
            raise InvalidInputError(
                f"{where} has tensor_content and {typed[0]}; send its elements one way"
            )
        if len(content) != count * sent.itemsize:
            raise InvalidInputError(
                f"{where} has {len(content)} bytes of tensor_content; shape {dims} of "
                f"{dtype_name(tensor.dtype)} holds {count * sent.itemsize}"
            )
        array = np.frombuffer(content, dtype=sent).reshape(dims)
    else:
        array = _typed(where, tensor, known[1], sent, count).reshape(dims)
    return _convert(where, array, tensor.dtype, spec)


def _dims(
    where: str, tensor: tensor_pb2.TensorProto, spec: TensorSpec, limits: RequestLimits
) -> tuple[int, ...]:
    shape = tensor.tensor_shape
    if shape.unknown_rank:
        raise InvalidInputError(f"{where} has an unknown rank; send its shape, rows first")
    dims = tuple(int(d.size) for d in shape.dim)
    if not dims:
        raise InvalidInputError(
            f"{where} is a scalar; the model takes {spec.describe()}: send its rows, "
            "the first dimension the number of rows"
        )
    if any(d < 0 for d in dims):
        raise InvalidInputError(f"{where} has shape {list(dims)}; every size must be known")
    if dims[0] == 0:
        raise InvalidInputError(f"{where} has no rows; send at least one")
    if not spec.matches_row_shape(dims[1:]):
        raise InvalidInputError(f"{where} has shape {list(dims)}; expected {spec.describe()}")
    limits.check_dims(where, dims, spec)
    return dims


def _typed(
    where: str, tensor: tensor_pb2.TensorProto, field: str, sent: np.dtype[Any], count: int
) -> np.ndarray:
    others = [f.name for f, _ in tensor.ListFields() if f.name in _TYPED_FIELDS - {field}]
    if others:
        raise InvalidInputError(
            f"{where} is {dtype_name(tensor.dtype)}, whose elements go in {field} (or "
            f"tensor_content); got {others[0]}"
        )
    values = getattr(tensor, field)
    if len(values) not in (1, count):
        raise InvalidInputError(
            f"{where} has {len(values)} values in {field}; its shape holds {count} (or send "
            "one value for all)"
        )
    if field == "half_val":  # 16-bit patterns in int32s, as TensorFlow packs them
        array = np.array(values, dtype=np.int32).astype(np.uint16).view(sent)
    elif field == "int_val" and sent.itemsize < 4:
        # int_val carries int8 to uint16 in int32s: numpy raises OverflowError on a value
        # outside the narrower dtype, so the range is checked in the wire's width first.
        wide = np.array(values, dtype=np.int32)
        info = np.iinfo(sent)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise InvalidInputError(
                f"{where} holds values outside the range of {dtype_name(tensor.dtype)} "
                f"({info.min} to {info.max})"
            )
        array = wide.astype(sent)
    else:
        array = np.array(values, dtype=sent)
    return np.broadcast_to(array, (count,)) if len(values) == 1 else array


def _convert(where: str, array: np.ndarray, dtype: int, spec: TensorSpec) -> np.ndarray:
    want = spec.np_dtype
    if array.dtype == want:
        return array
    sent, kind = dtype_name(dtype), want.kind
    if array.dtype.kind == "b" and kind != "b":
        raise InvalidInputError(
            f"{where} is {sent} (booleans); the model takes numbers {spec.describe()}"
        )
    if kind == "b" or (kind in "iu" and array.dtype.kind not in "iu"):
        raise InvalidInputError(
            f"{where} is {sent}; the model takes {spec.describe()}: send it as "
            f"{dtype_name(data_type(want))}"
        )
    if kind in "iu" and array.size:
        info = np.iinfo(want)
        if array.min() < info.min or array.max() > info.max:
            raise InvalidInputError(f"{where} holds values outside the range of {spec.dtype}")
    return array.astype(want)


def encode_tensor(array: np.ndarray, tensor: tensor_pb2.TensorProto) -> None:
    """Write ``array`` into ``tensor`` (a map entry of the answer: filled in place, not
    copied): its dtype, shape and ``tensor_content``."""
    tensor.dtype = data_type(array.dtype)
    dims = tensor.tensor_shape.dim
    for size in array.shape:
        dims.add(size=size)
    little = array if array.dtype.byteorder != ">" else array.astype(array.dtype.newbyteorder("<"))
    tensor.tensor_content = little.tobytes()


def signature_def(signature: ModelSignature) -> meta_graph_pb2.SignatureDef:
    """The model's ``serving_default`` signature: every input and output with its dtype and
    shape, -1 for the rows and for each length the model leaves unknown."""
    sig = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
    for specs, infos in ((signature.inputs, sig.inputs), (signature.outputs, sig.outputs)):
        for spec in specs:
            info = infos[spec.name]
            info.name = spec.name
            info.dtype = data_type(spec.np_dtype)
            dims = info.tensor_shape.dim
            for size in (-1, *(-1 if d is None else d for d in spec.shape)):
                dims.add(size=size)
    return sig
