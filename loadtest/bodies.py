"""Request bodies of each protocol, made once before a load test (no Locust import here: the
benchmarks use them too, and importing Locust patches the process for gevent)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

PROTOCOLS = ("tfserving", "v2-json", "v2-binary")


def random_inputs(
    metadata: dict[str, Any], rows: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """One request's worth of random rows fitting the signature, by input name."""
    inputs = {}
    for spec in metadata["inputs"]:
        shape = (rows, *(1 if d is None else int(d) for d in spec["shape"]))
        dtype = np.dtype(spec["dtype"])
        if dtype.kind in "iu":
            value = rng.integers(0, 2, size=shape).astype(dtype)
        elif dtype.kind == "b":
            value = rng.integers(0, 2, size=shape).astype(bool)
        else:
            value = rng.standard_normal(shape).astype(dtype).round(4)
        inputs[spec["name"]] = value
    return inputs


def encode_body(inputs: dict[str, np.ndarray], protocol: str) -> tuple[bytes, dict[str, str]]:
    """The body and headers of one request in ``protocol``."""
    from serving.protocols.v2.datatypes import datatype_of

    if protocol == "tfserving":
        columns = {name: value.tolist() for name, value in inputs.items()}
        body = json.dumps({"inputs": columns}, separators=(",", ":")).encode()
        return body, {"Content-Type": "application/json"}
    tensors = []
    for name, value in inputs.items():
        tensor: dict[str, Any] = {
            "name": name, "shape": list(value.shape), "datatype": datatype_of(value.dtype)
        }  # fmt: skip
        if protocol == "v2-json":
            tensor["data"] = value.ravel().tolist()
        else:
            tensor["parameters"] = {"binary_data_size": value.nbytes}
        tensors.append(tensor)
    if protocol == "v2-json":
        body = json.dumps({"inputs": tensors}, separators=(",", ":")).encode()
        return body, {"Content-Type": "application/json"}
    header = json.dumps(
        {"inputs": tensors, "parameters": {"binary_data_output": True}}, separators=(",", ":")
    ).encode()
    raw = b"".join(np.ascontiguousarray(v).astype(v.dtype.newbyteorder("<")).tobytes()
                   for v in inputs.values())  # fmt: skip
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return header + raw, headers


def request_path(protocol: str, model_name: str) -> str:
    return "/predict" if protocol == "tfserving" else f"/v2/models/{model_name}/infer"


def make_bodies(
    metadata: dict[str, Any], rows: int, count: int, seed: int, protocol: str = "tfserving"
) -> list[bytes]:
    """``count`` request bodies of ``rows`` random rows fitting the signature."""
    if rows < 1:
        raise ValueError(f"--rows must be >= 1, got {rows}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"--protocol must be one of {PROTOCOLS}, got {protocol!r}")
    rng = np.random.default_rng(seed)
    return [encode_body(random_inputs(metadata, rows, rng), protocol)[0] for _ in range(count)]
