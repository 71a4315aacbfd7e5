"""The body of a V2 infer request and of its response over HTTP (binary tensor data extension).

A body is a JSON object, then the raw bytes of each tensor that carries
``parameters.binary_data_size``, in the order of the JSON's ``inputs`` (``outputs`` in a
response); the ``Inference-Header-Content-Length`` header gives the JSON object's length.
Without binary tensors the whole body is the JSON object. The tensors themselves are read and
written by ``serving.protocols.v2.tensors``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from serving.errors import InvalidInputError
from serving.http.replies import JSON, OCTET_STREAM, Reply
from serving.protocols.json_strings import string_quotes
from serving.protocols.limits import DEFAULT_LIMITS, RequestLimits
from serving.protocols.v2.datatypes import BINARY_ONLY
from serving.protocols.v2.parameters import timeout_s
from serving.protocols.v2.tensors import decode_tensor, encode_tensor, spec_datatype
from serving.quoting import MAX_QUOTED, clip, quote
from shards.signature import ModelSignature, TensorSpec

__all__ = ["HEADER_LENGTH", "InferCall", "encode_infer", "parse_infer"]

HEADER_LENGTH = "inference-header-content-length"
VERSION = "1"  # the one version a model is served as, while there is one


@dataclass(frozen=True)
class InferCall:
    """A parsed infer request: input arrays by name, outputs asked for (name, as binary)."""

    inputs: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]]
    id: str | None
    timeout_s: float | None


@dataclass(frozen=True)
class _Parts:
    """A signature's names and specs by name, built once (four per request otherwise)."""

    signature: ModelSignature
    input_names: list[str]
    output_names: list[str]
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]


_PARTS: dict[int, _Parts] = {}


def _parts(signature: ModelSignature) -> _Parts:
    parts = _PARTS.get(id(signature))
    if parts is None or parts.signature is not signature:
        if len(_PARTS) > 16:
            _PARTS.clear()
        parts = _PARTS[id(signature)] = _Parts(
            signature,
            signature.input_names,
            signature.output_names,
            {spec.name: spec for spec in signature.inputs},
            {spec.name: spec for spec in signature.outputs},
        )
    return parts


@dataclass(frozen=True)
class _Layout:
    """What a JSON header of binary tensors alone decides: every input's slice of the binary
    part, dtype and shape, and the outputs asked for. Clients send the same header for every
    request of a shape (tritonclient, perf tools), so it is checked once and kept."""

    signature: ModelSignature
    inputs: tuple[tuple[str, np.dtype[Any], tuple[int, ...], int, int], ...]
    binary_bytes: int
    outputs: list[tuple[str, bool]]
    timeout_s: float | None

    def call(self, binary: memoryview) -> InferCall:
        arrays = {
            name: np.frombuffer(binary[start:stop], dtype=dtype).reshape(shape)
            for name, dtype, shape, start, stop in self.inputs
        }
        return InferCall(arrays, self.outputs, None, self.timeout_s)


_LAYOUTS: dict[bytes, _Layout] = {}
_LAYOUT_HEADER_BYTES = 4096  # longer headers are not kept
_LAYOUT_COUNT = 256


def parse_infer(
    body: bytes | bytearray,
    header_length: str | None,
    signature: ModelSignature,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> InferCall:
    """The request's arrays and what it asks for. The JSON header is held to ``limits`` before
    it is parsed, and each input's declared shape before its data is shaped by it."""
    header, binary = _split_body(body, header_length)
    key = bytes(header) if binary and len(header) <= _LAYOUT_HEADER_BYTES else None
    if key is not None:
        layout = _LAYOUTS.get(key)
        if (
            layout is not None
            and layout.signature is signature
            and layout.binary_bytes == len(binary)
        ):
            return layout.call(binary)
    call = _parse(header, binary, body, signature, limits)
    if key is not None and call.id is None:
        layout = _layout(call, binary, signature)
        if layout is not None:
            if len(_LAYOUTS) >= _LAYOUT_COUNT:
                _LAYOUTS.clear()
            _LAYOUTS[key] = layout
    return call


def _layout(call: InferCall, binary: memoryview, signature: ModelSignature) -> _Layout | None:
    """The layout of ``call``, parsed in full, if every input is a view of ``binary`` (not
    JSON data, not converted, not BOOL, whose bytes are checked per request)."""
    base = np.frombuffer(binary, dtype=np.uint8)
    start_of = base.__array_interface__["data"][0]
    inputs = []
    for name, arr in call.inputs.items():
        if arr.dtype == np.bool_ or arr.base is None or not arr.flags.c_contiguous:
            return None
        start = arr.__array_interface__["data"][0] - start_of
        if not 0 <= start <= len(binary) - arr.nbytes:
            return None
        inputs.append((name, arr.dtype, arr.shape, start, start + arr.nbytes))
    return _Layout(signature, tuple(inputs), len(binary), call.outputs, call.timeout_s)


def _parse(
    header: memoryview,
    binary: memoryview,
    body: bytes | bytearray,
    signature: ModelSignature,
    limits: RequestLimits,
) -> InferCall:
    limits.check_json(body, signature, len(header))  # the header is the body's first bytes
    try:
        payload = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise InvalidInputError(f"the inference request is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidInputError(
            f'the inference request must be a JSON object with "inputs", got '
            f"{type(payload).__name__}"
        )
    rid = payload.get("id")
    if rid is not None and not isinstance(rid, str):
        raise InvalidInputError(f'"id" must be a string, got {type(rid).__name__}')
    params = _object(payload.get("parameters"), '"parameters"')
    binary_default = _flag(params, "binary_data_output", '"parameters"')
    timeout = params.get("timeout")
    if timeout is not None and (not isinstance(timeout, int) or isinstance(timeout, bool)):
        raise InvalidInputError(
            f'parameter "timeout" is in microseconds (an integer), got {quote(timeout)}'
        )
    seconds = None if timeout is None else timeout_s(timeout)
    # Only a JSON header that holds true or false somewhere needs its data scanned for booleans.
    end = len(header)
    maybe_bool = body.find(b"true", 0, end) >= 0 or body.find(b"false", 0, end) >= 0
    # Only one with more '"' than its keys and strings outside "data" take may hold a string
    # in its data (serving.protocols.json_strings).
    maybe_str = body.count(b'"', 0, end) > string_quotes(payload)
    inputs = _inputs(payload.get("inputs"), binary, signature, maybe_bool, limits, maybe_str)
    outputs = _outputs(payload.get("outputs"), binary_default, signature)
    return InferCall(inputs, outputs, rid, seconds)


def _split_body(
    body: bytes | bytearray, header_length: str | None
) -> tuple[memoryview, memoryview]:
    view = memoryview(body)
    if header_length is None:
        return view, view[:0]
    if not (header_length.isascii() and header_length.isdigit()):
        raise InvalidInputError(
            f"header Inference-Header-Content-Length must be the JSON header's length in bytes, "
            f"got {quote(header_length)}"
        )
    # More digits than the body's length has is too long before int() (past 4,300 it raises).
    length = int(header_length) if len(header_length) <= len(str(len(body))) else len(body) + 1
    if length > len(body):
        raise InvalidInputError(
            f"header Inference-Header-Content-Length is {clip(header_length, MAX_QUOTED)} but "
            f"the body has only {len(body)} bytes"
        )
    return view[:length], view[length:]


def _object(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInputError(f"{where} must be an object, got {type(value).__name__}")
    return value


def _flag(params: dict[str, Any], key: str, where: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise InvalidInputError(f'{where}: "{key}" must be true or false, got {quote(value)}')
    return value


def _inputs(
    entries: Any,
    binary: memoryview,
    signature: ModelSignature,
    maybe_bool: bool,
    limits: RequestLimits,
    maybe_str: bool,
) -> dict[str, np.ndarray]:
    parts = _parts(signature)
    names, specs = parts.input_names, parts.inputs
    if not isinstance(entries, list) or not entries:
        raise InvalidInputError(f'"inputs" must be a non-empty list of the model\'s inputs {names}')
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise InvalidInputError(f'"inputs"[{i}] must be an object with a "name" string')
        name = entry["name"]
        spec = specs.get(name)
        if spec is None:
            raise InvalidInputError(f"unknown input {quote(name)}; the model's inputs are {names}")
        if name in arrays:
            raise InvalidInputError(f"input {quote(name)} is given twice")
        where = f"input {quote(name)}"
        params = _object(entry.get("parameters"), f"{where}: parameters")
        if any(key.startswith("shared_memory") for key in params):
            raise InvalidInputError(f"{where} uses shared memory, which this server does not serve")
        size = params.get("binary_data_size")
        data: Any
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidInputError(f"{where}: binary_data_size must be an integer >= 0")
            if "data" in entry:
                raise InvalidInputError(f'{where} has both "data" and binary_data_size; send one')
            if offset + size > len(binary):
                raise InvalidInputError(
                    f"{where} has binary_data_size {size} but only {len(binary) - offset} bytes "
                    "of binary data are left after the JSON header"
                )
            data = binary[offset : offset + size]
            offset += size
        elif "data" in entry:
            data = entry["data"]
        else:
            raise InvalidInputError(f'{where} has neither "data" nor binary_data_size')
        arrays[name] = decode_tensor(
            name,
            entry.get("datatype"),
            entry.get("shape"),
            data,
            spec,
            maybe_bool,
            limits,
            maybe_str,
        )
    if offset != len(binary):
        raise InvalidInputError(
            f"the body has {len(binary) - offset} bytes after the JSON header that no input's "
            "binary_data_size accounts for"
        )
    missing = [name for name in names if name not in arrays]
    if missing:
        raise InvalidInputError(f"missing input(s) {missing}; the model's inputs are {names}")
    rows = {name: arr.shape[0] for name, arr in arrays.items()}
    if len(set(rows.values())) != 1:
        raise InvalidInputError(f"inputs have different row counts {rows}; all must be equal")
    return arrays


def _outputs(
    entries: Any, binary_default: bool, signature: ModelSignature
) -> list[tuple[str, bool]]:
    parts = _parts(signature)
    names = parts.output_names
    if entries is None or entries == []:  # absent or []: every output
        asked = [(name, binary_default) for name in names]
    else:
        if not isinstance(entries, list):
            raise InvalidInputError(
                f'"outputs" must be a list of objects, got {type(entries).__name__}'
            )
        asked = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise InvalidInputError(f'"outputs"[{i}] must be an object with a "name" string')
            name = entry["name"]
            if name not in names:
                raise InvalidInputError(
                    f"unknown output {quote(name)}; the model's outputs are {names}"
                )
            if any(name == seen for seen, _ in asked):
                raise InvalidInputError(f"output {quote(name)} is asked for twice")
            params = _object(entry.get("parameters"), f"output {quote(name)}: parameters")
            if params.get("classification") or any(k.startswith("shared_memory") for k in params):
                raise InvalidInputError(
                    f"output {quote(name)}: classification and shared memory are not served"
                )
            binary = _flag(params, "binary_data", f"output {quote(name)}: parameters")
            asked.append((name, binary if "binary_data" in params else binary_default))
    specs = parts.outputs
    for name, binary in asked:
        datatype = spec_datatype(specs[name])
        if not binary and datatype in BINARY_ONLY:
            raise InvalidInputError(
                f"output {quote(name)} is {datatype}, which JSON cannot carry; ask for it as "
                'binary data (output parameter "binary_data": true)'
            )
    return asked


def encode_infer(
    outputs: dict[str, np.ndarray],
    call: InferCall,
    signature: ModelSignature,
    model_name: str,
    model_version: str = VERSION,
) -> Reply:
    """The answer: ``(200, body, content type, headers)`` (``serving.http.replies.Reply``)."""
    specs = _parts(signature).outputs
    entries: list[dict[str, Any]] = []
    buffers: list[memoryview] = []
    for name, binary in call.outputs:
        tensor = encode_tensor(name, outputs[name], specs[name])
        entry: dict[str, Any] = {"name": name, "datatype": tensor.datatype, "shape": tensor.shape}
        if binary:
            entry["parameters"] = {"binary_data_size": tensor.array.nbytes}
            buffers.append(tensor.buffer())
        else:
            entry["data"] = tensor.flat()
        entries.append(entry)
    body: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if call.id is not None:
        body["id"] = call.id
    body["outputs"] = entries
    header = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    if not buffers:
        return 200, header, JSON, []
    length = [(b"inference-header-content-length", b"%d" % len(header))]
    return 200, b"".join([header, *buffers]), OCTET_STREAM, length
