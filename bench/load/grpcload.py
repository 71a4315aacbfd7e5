"""A closed-loop gRPC load over ``tritonclient.grpc.aio`` (``python -m bench.load.grpcload``).

N coroutines on one channel, each sending ``ModelInfer`` with the row as raw contents as soon as
its last answer came, for a fixed time; one JSON line out (``bench.load.loops.LoadResult``). The
inputs are prepared once, so the client's CPU goes to gRPC and protobuf, not to numpy. Every
call has a deadline, so a stuck server costs at most ``seconds + timeout``.

``--raw`` (``bench frontcpu``'s client, where the client's CPU must not crowd the front end's):
the ``ModelInferRequest`` is serialized once and sent as those bytes on a bare ``grpc.aio``
channel, its answers left unparsed: no protobuf and no tritonclient work per call.
``--raw --tfserving``: the same with TF Serving's ``PredictRequest`` (each input a
``TensorProto`` with ``tensor_content``, what ``tf.make_tensor_proto`` sends), to
``tensorflow.serving.PredictionService/Predict``; serialized with the server's own compiled
messages (``serving.protocols.tfserving.proto``), so the generator imports no TensorFlow.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

from bench import options
from bench.load.result import LoadResult, from_latencies, run_child


async def closed_loop(
    url: str,
    model: str,
    inputs: dict[str, np.ndarray],
    concurrency: int,
    seconds: float,
    timeout_s: float = 30.0,
) -> LoadResult:
    import tritonclient.grpc.aio as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    tensors = []
    for name, value in inputs.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    latencies: list[float] = []
    errors = 0
    first_error = ""
    client = grpcclient.InferenceServerClient(url)
    try:
        start = time.perf_counter()
        end = start + seconds

        async def one_client() -> None:
            nonlocal errors, first_error
            while time.perf_counter() < end:
                tick = time.perf_counter()
                try:
                    await client.infer(model, tensors, client_timeout=timeout_s)
                except InferenceServerException as exc:
                    errors += 1
                    first_error = first_error or str(exc)[:300]
                latencies.append(time.perf_counter() - tick)

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    finally:
        await client.close()
    if errors:
        print(f"{errors} calls failed; the first: {first_error}", file=sys.stderr)
    return from_latencies(
        "closed", concurrency, None, latencies, errors, elapsed, "tritonclient.grpc.aio"
    )


MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
TF_PREDICT = "/tensorflow.serving.PredictionService/Predict"


def infer_request(model: str, inputs: dict[str, np.ndarray]) -> bytes:
    """One ``ModelInferRequest`` for ``model``, its tensors as raw contents, serialized."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype

    request = service_pb2.ModelInferRequest(model_name=model)
    for name, value in inputs.items():
        tensor = request.inputs.add(name=name, datatype=np_to_triton_dtype(value.dtype))
        tensor.shape.extend(value.shape)
        request.raw_input_contents.append(np.ascontiguousarray(value).tobytes())
    return bytes(request.SerializeToString())


def predict_request(model: str, inputs: dict[str, np.ndarray]) -> bytes:
    """One TF Serving ``PredictRequest`` for ``model``, its tensors as ``tensor_content``,
    serialized."""
    from serving.protocols.tfserving.proto import predict_pb2
    from serving.protocols.tfserving.tensors import encode_tensor

    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    for name, value in inputs.items():
        encode_tensor(np.ascontiguousarray(value), request.inputs[name])
    return bytes(request.SerializeToString())


async def raw_closed_loop(
    url: str,
    request: bytes,
    concurrency: int,
    seconds: float,
    timeout_s: float = 30.0,
    method: str = MODEL_INFER,
) -> LoadResult:
    """The closed loop of ``closed_loop`` with one pre-serialized request on a bare channel."""
    import grpc

    latencies: list[float] = []
    errors = 0
    first_error = ""
    async with grpc.aio.insecure_channel(url) as channel:
        # No serializers: the request goes as its bytes, the answer comes back as bytes.
        infer = channel.unary_unary(method)
        start = time.perf_counter()
        end = start + seconds

        async def one_client() -> None:
            nonlocal errors, first_error
            while time.perf_counter() < end:
                tick = time.perf_counter()
                try:
                    await infer(request, timeout=timeout_s)
                except grpc.aio.AioRpcError as exc:
                    errors += 1
                    first_error = first_error or f"{exc.code().name}: {exc.details()}"[:300]
                latencies.append(time.perf_counter() - tick)

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    if errors:
        print(f"{errors} calls failed; the first: {first_error}", file=sys.stderr)
    return from_latencies("closed", concurrency, None, latencies, errors, elapsed, "grpc.aio raw")


def run(
    url: str,
    model: str,
    inputs: Path,
    concurrency: int,
    seconds: float,
    raw: bool = False,
    tfserving: bool = False,
) -> LoadResult:
    """The generator in a child process: ``inputs`` (an .npz) sent to ``model`` at ``url``;
    ``raw``: pre-serialized on a bare channel (``raw_closed_loop``); ``tfserving``: as TF
    Serving's ``Predict`` (pre-serialized too)."""
    args = ["--url", url, "--model", model, "--inputs", str(inputs)]
    args += ["--concurrency", str(concurrency), "--seconds", f"{seconds:g}"]
    args += ["--raw"] if raw or tfserving else []
    args += ["--tfserving"] if tfserving else []
    return run_child("bench.load.grpcload", args, timeout_s=seconds + 120)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.load.grpcload", description=__doc__)
    opts = options.Options(parser)
    opts.add("url", required=True, help="host:port of the gRPC server")
    opts.add("model", required=True)
    opts.own("--inputs", required=True, type=Path, help=".npz of the request's inputs")
    opts.add("concurrency", required=True)
    opts.add("seconds", default=5.0)
    parser.add_argument(
        "--raw", action="store_true", help="one pre-serialized request on a bare grpc.aio channel"
    )
    parser.add_argument(
        "--tfserving", action="store_true", help="with --raw: TF Serving's Predict, not ModelInfer"
    )
    args = parser.parse_args()
    if args.concurrency < 1 or args.seconds <= 0:
        sys.exit("--concurrency must be >= 1 and --seconds > 0")
    with np.load(args.inputs) as data:
        inputs = {name: data[name] for name in data.files}
    if args.raw and args.tfserving:
        request = predict_request(args.model, inputs)
        loop = raw_closed_loop(args.url, request, args.concurrency, args.seconds, method=TF_PREDICT)
    elif args.raw:
        request = infer_request(args.model, inputs)
        loop = raw_closed_loop(args.url, request, args.concurrency, args.seconds)
    else:
        loop = closed_loop(args.url, args.model, inputs, args.concurrency, args.seconds)
    result = asyncio.run(loop)
    result.print_line()


if __name__ == "__main__":
    main()
