"""TensorFlow Serving's gRPC API: ``tensorflow.serving.PredictionService`` and
``tensorflow.serving.ModelService`` on the gRPC port (``serving.protocols.grpc_port``), so that a
client of the official ``tensorflow-serving-api`` stubs switches by changing only the address.

- ``Predict``: ``model_spec`` names the model and its ``version`` or ``version_label`` (none: the
  server's choice, a turn of a canary's split); ``signature_name`` is ``serving_default`` or
  empty. ``inputs`` are ``TensorProto``s (``serving.protocols.tfserving.tensors``); the answer's
  ``outputs`` carry ``tensor_content``, only those of ``output_filter`` where it is given, and
  its ``model_spec`` the version that answered. It is the data plane's
  (``serving.protocols.dataplane.infer``), so its rows batch with every other protocol's in the
  model's one queue; a ``TensorProto`` is rectangular, and requests of different lengths share
  batches through the batcher's length padding, as V2's do.
- ``GetModelMetadata`` with ``metadata_field: ["signature_def"]``: a ``SignatureDefMap`` packed
  in an ``Any`` (``type.googleapis.com/tensorflow.serving.SignatureDefMap``).
- ``GetModelStatus``: every version's state (``serving.protocols.tfserving.status``), or the one
  the spec names.
- ``Classify``, ``Regress``, ``MultiInference`` and ``HandleReloadConfigRequest``: UNIMPLEMENTED.

An empty ``model_spec.name`` means the default model (``/predict``'s). Errors are the call's
status (``serving.protocols.grpc_call``'s table), as TF Serving's: INVALID_ARGUMENT for a bad
tensor, NOT_FOUND for an unknown model, version or label, UNAVAILABLE (with ``retry-after``)
for a full queue or a version not ready, DEADLINE_EXCEEDED, and RESOURCE_EXHAUSTED for a message
over ``max_body_bytes`` (gRPC refuses it before it is decoded). A ``Predict`` message with more
than its model's queue can take is INVALID_ARGUMENT before protobuf parses it (``grpc_bounds``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from serving.errors import InvalidInputError, ShardServeError
from serving.protocols.contract import ModelDirectory, ModelHandle
from serving.protocols.dataplane import infer, submit
from serving.protocols.grpc_call import (
    Context,
    GrpcCall,
    GrpcTransport,
    Handlers,
    Refused,
    abort,
    refuse,
    request_id,
)
from serving.protocols.limits import request_limits
from serving.protocols.tfserving.grpc_bounds import Selector, scan_predict_request
from serving.protocols.tfserving.proto import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)
from serving.protocols.tfserving.status import tfserving_status
from serving.protocols.tfserving.tensors import decode_tensor, encode_tensor, signature_def
from serving.protocols.wire import InferBounds
from serving.quoting import quote, quote_all

if TYPE_CHECKING:
    import numpy as np

    from serving.batching.batcher import Batcher

__all__ = ["SIGNATURE", "ModelServicer", "PredictionServicer", "add_tfserving_services"]

SIGNATURE = "serving_default"
_Call = GrpcCall[predict_pb2.PredictRequest]
_PREDICT = GrpcTransport("Predict")
_State = get_model_status_pb2.ModelVersionStatus.State
_UNAVAILABLE_CODE = 14  # tensorflow.error.Code.UNAVAILABLE


def _selector(spec: model_pb2.ModelSpec) -> tuple[str | None, str | None, str | None]:
    """(name, version, label) of a ``ModelSpec``; ``None`` where it leaves one out."""
    version = str(spec.version.value) if spec.HasField("version") else None
    return spec.name or None, version, spec.version_label or None


def _answer_spec(spec: model_pb2.ModelSpec, model: ModelHandle) -> None:
    spec.name = model.name
    if model.version.isdigit():
        spec.version.value = int(model.version)
    spec.signature_name = SIGNATURE


def _check_signature(name: str) -> None:
    if name not in ("", SIGNATURE):
        raise InvalidInputError(
            f"signature {quote(name)} is not served; the model's one signature is {SIGNATURE!r} "
            "(or leave signature_name empty)"
        )


class PredictionServicer(prediction_service_pb2_grpc.PredictionServiceServicer):
    def __init__(self, models: ModelDirectory) -> None:
        self._models = models

    def read_predict(self, data: bytes) -> predict_pb2.PredictRequest | Refused:
        """``Predict``'s deserializer: the message, or its refusal where it holds more than a
        request to the model it names could (``grpc_bounds``), before protobuf parses it."""
        named: list[ModelHandle] = []

        def bounds_of(selector: Selector) -> InferBounds:
            name, version, label = selector
            model = self._models.model(name, version, label, split=False)
            named.append(model)
            limits = request_limits(model, model.require_batcher())
            return InferBounds.of(model.name, model.signature, limits)

        try:
            scan_predict_request(data, bounds_of)
            return predict_pb2.PredictRequest.FromString(data)
        except ShardServeError as exc:
            return Refused(exc, named[-1] if named else None)
        except DecodeError:  # a string that is not UTF-8: gRPC would say UNKNOWN
            invalid = InvalidInputError(
                "the message is not a valid PredictRequest (protobuf could not parse it); send "
                "one your client's TensorFlow Serving stubs serialize"
            )
            return Refused(invalid, named[-1] if named else None)

    async def Predict(self, request: predict_pb2.PredictRequest | Refused, context: Context) -> Any:
        if isinstance(request, Refused):
            started = time.perf_counter()
            await refuse(context, request, request_id(context), started, "Predict")
        name, version, label = _selector(request.model_spec)
        call: _Call = GrpcCall(request, context, request_id(context))
        return await infer(self._models, name, version, label, call, None, _predict, _PREDICT)

    async def GetModelMetadata(
        self, request: get_model_metadata_pb2.GetModelMetadataRequest, context: Context
    ) -> Any:
        try:
            model = _look(self._models, request.model_spec)
            fields = list(request.metadata_field)
            if fields != ["signature_def"]:
                raise InvalidInputError(
                    f"metadata_field is {quote_all(fields)}; this server answers ['signature_def']"
                )
            _check_signature(request.model_spec.signature_name)
            signatures = get_model_metadata_pb2.SignatureDefMap()
            signatures.signature_def[SIGNATURE].CopyFrom(signature_def(model.signature))
        except ShardServeError as exc:
            await abort(context, exc, request_id(context))
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        _answer_spec(response.model_spec, model)
        response.metadata["signature_def"].Pack(signatures)
        return response

    async def Classify(self, request: Any, context: Context) -> Any:
        await _unimplemented(context, "Classify")

    async def Regress(self, request: Any, context: Context) -> Any:
        await _unimplemented(context, "Regress")

    async def MultiInference(self, request: Any, context: Context) -> Any:
        await _unimplemented(context, "MultiInference")


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, models: ModelDirectory) -> None:
        self._models = models

    async def GetModelStatus(
        self, request: get_model_status_pb2.GetModelStatusRequest, context: Context
    ) -> Any:
        spec = request.model_spec
        try:
            model = _look(self._models, spec)
            if spec.HasField("version") or spec.version_label:
                versions = [model]
            else:  # TF Serving lists every version of the model
                versions = [
                    self._models.model(model.name, v, split=False)
                    for v in self._models.versions(model.name)
                ]
        except ShardServeError as exc:
            await abort(context, exc, request_id(context))
        response = get_model_status_pb2.GetModelStatusResponse()
        for served in versions:
            status = tfserving_status(served)
            entry = response.model_version_status.add()
            entry.version = int(served.version) if served.version.isdigit() else 0
            entry.state = _State.Value(status.state)
            if status.error_code != "OK":
                entry.status.error_code = _UNAVAILABLE_CODE  # type: ignore[assignment]
            entry.status.error_message = status.message
        return response

    async def HandleReloadConfigRequest(self, request: Any, context: Context) -> Any:
        await _unimplemented(
            context,
            "HandleReloadConfigRequest",
            "; load and unload models through the model repository API instead (V2's "
            "RepositoryModelLoad/RepositoryModelUnload, or POST /v2/repository/models/{m}/load)",
        )


def _look(models: ModelDirectory, spec: model_pb2.ModelSpec) -> ModelHandle:
    """The version ``spec`` names for a look (metadata, status): no turn of a canary's split."""
    name, version, label = _selector(spec)
    return models.model(name, version, label, split=False)


async def _unimplemented(context: Context, method: str, hint: str = "") -> None:
    await context.abort(
        grpc.StatusCode.UNIMPLEMENTED,
        f"{method} is not served by this server; call Predict{hint}",
        trailing_metadata=(("x-request-id", request_id(context)),),
    )


async def _predict(
    call: _Call, model: ModelHandle, batcher: Batcher, deadline: float
) -> predict_pb2.PredictResponse:
    """The work of one admitted call (the data plane's ``Work``): decode, submit, encode."""
    request = call.message
    _check_signature(request.model_spec.signature_name)
    signature = model.signature
    limits = request_limits(model, batcher)
    names = signature.input_names
    given = request.inputs
    unknown = [key for key in given if key not in names]
    if unknown:
        raise InvalidInputError(
            f"unknown input(s) {quote_all(unknown, sort=True)}; the model's inputs are {names}"
        )
    missing = [name for name in names if name not in given]
    if missing:
        raise InvalidInputError(f"missing input(s) {missing}; the model's inputs are {names}")
    inputs: dict[str, np.ndarray] = {
        spec.name: decode_tensor(spec.name, given[spec.name], spec, limits)
        for spec in signature.inputs
    }
    rows = {name: array.shape[0] for name, array in inputs.items()}
    if len(set(rows.values())) != 1:
        raise InvalidInputError(f"inputs have different row counts {rows}; all must be equal")
    outputs = _output_names(request, signature.output_names)
    answers = await submit(inputs, model, batcher, deadline, call.rid)
    response = predict_pb2.PredictResponse()
    _answer_spec(response.model_spec, model)
    for name in outputs:
        encode_tensor(answers[name], response.outputs[name])
    return response


def _output_names(request: predict_pb2.PredictRequest, names: list[str]) -> list[str]:
    asked = list(request.output_filter)
    if not asked:
        return names
    for i, name in enumerate(asked):
        if name not in names:
            raise InvalidInputError(
                f"output_filter names {quote(name)}; the model's outputs are {names}"
            )
        if name in asked[:i]:
            raise InvalidInputError(f"output_filter names {quote(name)} twice")
    return asked


def add_tfserving_services(server: grpc.aio.Server, models: ModelDirectory) -> list[str]:
    """Serve ``PredictionService`` and ``ModelService`` on ``server``; their full names."""
    servicer = PredictionServicer(models)
    generated = Handlers()
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(  # type: ignore[no-untyped-call]
        servicer, generated
    )
    # Predict's message is checked against its model's limits before it is parsed; the other
    # calls' messages are small.
    generated.bound_small()
    generated.handlers["Predict"] = grpc.unary_unary_rpc_method_handler(
        servicer.Predict,
        request_deserializer=servicer.read_predict,
        response_serializer=predict_pb2.PredictResponse.SerializeToString,
    )
    generated.install(server)
    model_service = Handlers()
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(  # type: ignore[no-untyped-call]
        ModelServicer(models), model_service
    )
    model_service.bound_small()
    model_service.install(server)
    return ["tensorflow.serving.PredictionService", "tensorflow.serving.ModelService"]
