"""``python -m bench.bad_input``: what a bad 16 MiB request costs the server (issue 37, items 1
and 4). No Ray, no model: the fake runner of the tests.

- ``strings``: the server's peak RSS for a 16 MiB JSON body of one row of a 16 MiB string and
  1,023 empty ones (a 1,024-wide float32 model), to ``/predict`` and to V2's infer. The server
  runs in a process of its own (uvicorn, shardserve's protocol); its ``VmHWM`` is reset through
  ``/proc/<pid>/clear_refs`` before each body and read after. Goal: at most 4x the body.
- ``tfserving``: the time TF Serving's ``Predict`` deserializer holds the event loop before its
  refusal, for 16 MiB messages of several shapes (the goal: at most 50 ms), against a model
  whose request may hold 131,072 values (256 rows of 512 floats).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from serving.protocols.tfserving.proto import predict_pb2, tensor_pb2, types_pb2

MiB = 1 << 20
_TARGET = 16 * MiB - 4096  # under max_body_bytes (16 MiB) with the message's own fields

_SERVER = """
import sys
import uvicorn
from serving.http.protocol import http_protocol
from serving.server.app import create_app
from serving.settings.config import Settings
from shards.signature import ModelSignature, TensorSpec
from tests.fakes import FakeRunner

port, width = int(sys.argv[1]), int(sys.argv[2])
inputs = (TensorSpec("x", (width,), "float32"),)
runner = FakeRunner(ModelSignature("fake", inputs, (TensorSpec("y", (2,), "float32"),)))

async def factory(_):
    return runner

app = create_app(Settings(model="fake", batch_timeout_ms=0, grpc_port=0), factory)
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http=http_protocol(app),
            log_config=None)
"""


def strings(port: int, width: int = 1024, mib: float = 16.0) -> None:
    root = Path(__file__).resolve().parents[1]
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), str(width)], cwd=root)
    base = f"http://127.0.0.1:{port}"
    try:
        _until_ready(base)
        long = "s" * int(mib * MiB - 8192)
        row = [long] + [""] * (width - 1)
        tensor = {"name": "x", "shape": [1, width], "datatype": "FP32", "data": row}
        bodies = {
            "/predict": json.dumps({"instances": [row]}).encode(),
            "/v2/models/fake/infer": json.dumps({"inputs": [tensor]}).encode(),
        }
        with httpx.Client(base_url=base, timeout=120) as client:
            client.post("/predict", json={"instances": [[0.0] * width]})  # warm
            for path, body in bodies.items():
                Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
                before = _status(server.pid, "VmRSS")
                r = client.post(path, content=body, headers={"content-type": "application/json"})
                growth = _status(server.pid, "VmHWM") - before
                print(
                    f"{path}: a {len(body) / MiB:.1f} MiB body -> {r.status_code} "
                    f"{r.json()['error']!r}; the server's peak RSS +{growth / MiB:.1f} MiB "
                    f"({growth / len(body):.2f}x the body)"
                )
    finally:
        server.terminate()
        server.wait()


def _until_ready(base: str) -> None:
    for _ in range(600):
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not get ready")


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} for {pid}")


# ---- TF Serving's Predict ------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _spec() -> bytes:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "fake"
    return request.SerializeToString()


def _one_input(tensor: bytes) -> bytes:
    entry = b"\x0a\x01x\x12" + _varint(len(tensor)) + tensor
    return _spec() + b"\x12" + _varint(len(entry)) + entry


def _unknown_keys() -> bytes:
    request = predict_pb2.PredictRequest.FromString(_spec())
    one = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[1.0])
    size = len(predict_pb2.PredictRequest(inputs={"unknown-00000000": one}).SerializeToString())
    for i in range(_TARGET // size):
        request.inputs[f"unknown-{i:08d}"].CopyFrom(one)
    return request.SerializeToString()


def _packed_floats() -> bytes:
    return _one_input(b"\x2a" + _varint(_TARGET) + b"\x00" * _TARGET)


def _floats_one_field_each() -> bytes:
    return _one_input(b"\x2d\x00\x00\x80\x3f" * (_TARGET // 5))


def _varints_of_two_lengths() -> bytes:
    return _one_input((b"\x38\x01" + b"\x38\xac\x02") * (_TARGET // 5))


def _empty_packed_runs() -> bytes:
    return _one_input(b"\x2a\x00" * (_TARGET // 2))


def _output_filter() -> bytes:
    request = predict_pb2.PredictRequest.FromString(_spec())
    request.output_filter.extend(["y"] * (_TARGET // 3))
    return request.SerializeToString()


def _model_name() -> bytes:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "m" * _TARGET
    return request.SerializeToString()


def _tensor_content() -> bytes:
    return _one_input(b"\x22" + _varint(_TARGET) + b"\x00" * _TARGET)


MESSAGES: dict[str, Callable[[], bytes]] = {
    "unknown input keys": _unknown_keys,
    "one packed run of floats": _packed_floats,
    "floats one field each": _floats_one_field_each,
    "varints of 1 and 2 bytes one field each": _varints_of_two_lengths,
    "empty packed runs": _empty_packed_runs,
    "output_filter names": _output_filter,
    "a model name of 16 MiB": _model_name,
    "tensor_content": _tensor_content,
}


async def _tfserving() -> None:
    from serving.protocols.tfserving.grpc_service import PredictionServicer
    from shards.signature import ModelSignature, TensorSpec

    # the tests' fake runner and in-process server (from the repository root; not type-checked)
    fake_runner = importlib.import_module("tests.fakes").FakeRunner
    serve = importlib.import_module("tests.serving.protocols.v2.test_v2_grpc").serve

    tokens = (TensorSpec("x", (None,), "float32", pad_value=0),)
    signature = ModelSignature("fake", tokens, (TensorSpec("y", (4,), "float32"),))
    async with serve(fake_runner(signature), max_queue_rows=256) as served:
        servicer = PredictionServicer(served.state)
        for name, make in MESSAGES.items():
            data = make()
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                refused = servicer.read_predict(data)
                best = min(best, time.perf_counter() - start)
            error = getattr(refused, "error", None)
            said = f"{type(error).__name__}: {error.message[:70]}" if error else "parsed"
            print(f"{name:40s} {len(data) / MiB:5.1f} MiB {best * 1000:7.1f} ms  {said}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bad_input", description=__doc__)
    parser.add_argument("what", choices=["strings", "tfserving", "all"], nargs="?", default="all")
    parser.add_argument("--port", type=int, default=18130, help="the strings server's port")
    args = parser.parse_args(argv)
    if args.what in ("strings", "all"):
        strings(args.port)
    if args.what in ("tfserving", "all"):
        asyncio.run(_tfserving())


if __name__ == "__main__":
    main()
