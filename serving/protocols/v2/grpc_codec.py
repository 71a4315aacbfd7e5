"""V2 gRPC messages to arrays and back: ``ModelInferRequest``'s inputs (raw or typed
contents), the outputs it asks for and its ``timeout`` parameter; the answer's outputs, every
one in ``raw_output_contents``. Raw contents become arrays with ``np.frombuffer``; typed
``contents`` go through the JSON path's list checks (``serving.protocols.v2.tensors``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from serving.errors import InvalidInputError
from serving.protocols.limits import DEFAULT_LIMITS, RequestLimits
from serving.protocols.v2.parameters import timeout_s
from serving.protocols.v2.proto import grpc_service_pb2 as pb
from serving.protocols.v2.tensors import check_datatype, check_shape, decode_tensor, encode_tensor
from serving.quoting import quote
from shards.signature import ModelSignature, TensorSpec

__all__ = ["decode_inputs", "encode_outputs", "request_timeout_s", "requested_outputs"]

# The typed field of ``InferTensorContents`` that carries each datatype (FP16, BF16: raw only).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def decode_inputs(
    request: pb.ModelInferRequest, signature: ModelSignature, limits: RequestLimits = DEFAULT_LIMITS
) -> dict[str, Any]:
    """The request's arrays, each declared shape held to ``limits`` before its contents are
    read (a typed ``contents`` list becomes Python numbers: only once its length is right)."""
    names = signature.input_names
    specs = {spec.name: spec for spec in signature.inputs}
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInputError(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
            "give one per input, in the order of inputs"
        )
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        spec = specs.get(name)
        if spec is None:
            raise InvalidInputError(f"unknown input {quote(name)}; the model's inputs are {names}")
        if name in arrays:
            raise InvalidInputError(f"input {quote(name)} is given twice")
        if any(key.startswith("shared_memory") for key in tensor.parameters):
            raise InvalidInputError(
                f"input {quote(name)} uses shared memory, which this server does not serve"
            )
        where = f"input {quote(name)}"
        check_datatype(where, tensor.datatype, spec)
        dims = check_shape(where, list(tensor.shape), spec, limits)
        data: Any
        if raw:
            if tensor.HasField("contents"):
                raise InvalidInputError(
                    f"input {quote(name)} has contents while raw_input_contents is given; "
                    "send every input one way"
                )
            data = raw[i]
        else:
            data = _typed_contents(tensor, spec, math.prod(dims))
        arrays[name] = decode_tensor(
            name, tensor.datatype, list(tensor.shape), data, spec, limits=limits
        )
    missing = [name for name in names if name not in arrays]
    if missing:
        raise InvalidInputError(f"missing input(s) {missing}; the model's inputs are {names}")
    return arrays


def _typed_contents(
    tensor: pb.ModelInferRequest.InferInputTensor, spec: TensorSpec, count: int
) -> Any:
    where = f"input {quote(tensor.name)}"
    field = _CONTENTS_FIELD.get(tensor.datatype)
    if field is None:  # the model's own datatype (checked first), with no typed field
        raise InvalidInputError(
            f"{where} is {tensor.datatype}, which has no typed field in contents; "
            "send its bytes in raw_input_contents"
        )
    sent = [f.name for f, _ in tensor.contents.ListFields()]
    if any(name != field for name in sent):
        raise InvalidInputError(
            f"{where} is {tensor.datatype}, whose elements go in contents.{field}; "
            f"got contents.{', contents.'.join(sent)}"
        )
    contents = getattr(tensor.contents, field)
    if len(contents) != count:
        raise InvalidInputError(
            f"{where} has {len(contents)} values; shape {list(tensor.shape)} holds {count}"
        )
    return list(contents)


def requested_outputs(request: pb.ModelInferRequest, signature: ModelSignature) -> list[str]:
    names = signature.output_names
    if not request.outputs:
        return names
    asked: list[str] = []
    for output in request.outputs:
        if output.name not in names:
            raise InvalidInputError(
                f"unknown output {quote(output.name)}; the model's outputs are {names}"
            )
        if output.name in asked:
            raise InvalidInputError(f"output {quote(output.name)} is asked for twice")
        params = output.parameters
        if "classification" in params or any(k.startswith("shared_memory") for k in params):
            raise InvalidInputError(
                f"output {quote(output.name)}: classification and shared memory are not served"
            )
        asked.append(output.name)
    return asked


def request_timeout_s(request: pb.ModelInferRequest) -> float | None:
    """Triton's ``timeout`` request parameter (microseconds), if given."""
    param = request.parameters.get("timeout")
    if param is None:
        return None
    kind = param.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param"):
        raise InvalidInputError(
            f'parameter "timeout" is in microseconds (an integer), got a {kind or "empty value"}'
        )
    return timeout_s(int(getattr(param, kind)))


def encode_outputs(
    outputs: dict[str, np.ndarray], names: list[str], signature: ModelSignature
) -> tuple[list[pb.ModelInferResponse.InferOutputTensor], list[bytes]]:
    specs = {spec.name: spec for spec in signature.outputs}
    tensors, raw = [], []
    for name in names:
        tensor = encode_tensor(name, outputs[name], specs[name])
        tensors.append(
            pb.ModelInferResponse.InferOutputTensor(
                name=name, datatype=tensor.datatype, shape=tensor.shape
            )
        )
        raw.append(tensor.array.tobytes())
    return tensors, raw
