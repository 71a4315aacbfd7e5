"""What both V2 transports (HTTP, gRPC) say about the server and a model: its metadata and the
part of Triton's model config clients read. Each transport turns these dicts into its own
message (a JSON body checked against ``serving.openapi.v2_bodies``, a protobuf message)."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from serving.protocols.contract import ModelHandle
from serving.protocols.v2.tensors import tensor_config, tensor_metadata
from serving.settings.waits import is_auto

__all__ = [
    "EXTENSIONS",
    "PLATFORM",
    "SERVER_NAME",
    "model_config",
    "model_metadata",
    "server_metadata",
]

SERVER_NAME = "shardserve"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository"]
PLATFORM = "tensorflow_keras"


def server_metadata() -> dict[str, Any]:
    return {
        "name": SERVER_NAME,
        "version": importlib.metadata.version("shardserve"),
        "extensions": EXTENSIONS,
    }


def model_metadata(model: ModelHandle, versions: list[str] | None = None) -> dict[str, Any]:
    """``NotReadyError`` while the model loads (its signature is not known yet). ``versions``:
    every version of the model served (the one answering, when not given)."""
    signature = model.signature
    metadata: dict[str, Any] = {
        "name": model.name,
        "versions": versions or [model.version],
        "platform": PLATFORM,
        "inputs": [tensor_metadata(spec) for spec in signature.inputs],
        "outputs": [tensor_metadata(spec) for spec in signature.outputs],
    }
    # HTTP only: gRPC's ModelMetadataResponse has no parameters.
    parameters = {
        "length_padding": model.length_padding_parameters(),
        "replicas": model.scaling_parameters(),  # bounds, target count and why
    }
    if any(value is not None for value in parameters.values()):
        metadata["parameters"] = {k: v for k, v in parameters.items() if v is not None}
    return metadata


def model_config(model: ModelHandle) -> dict[str, Any]:
    """The batching the model runs with now (an admin PUT changes it), else at start-up;
    ``NotReadyError`` while the model loads."""
    signature = model.signature
    settings = model.settings
    policy = model.batcher.settings if model.batcher is not None else None
    max_batch = policy.max_batch_size if policy is not None else settings.max_batch_size
    wait_ms = policy.batch_timeout_ms if policy is not None else settings.batch_timeout_ms
    batching: dict[str, Any] = {}
    if not is_auto(wait_ms):  # the adaptive wait has no fixed delay to state
        batching["max_queue_delay_microseconds"] = round(float(wait_ms) * 1000)
    return {
        "name": model.name,
        "platform": PLATFORM,
        "backend": SERVER_NAME,
        "max_batch_size": max_batch,
        "input": [tensor_config(spec) for spec in signature.inputs],
        "output": [tensor_config(spec) for spec in signature.outputs],
        "dynamic_batching": batching,
    }
