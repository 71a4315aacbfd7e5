"""A closed-loop gRPC load over ``tritonclient.grpc.aio`` (``python -m bench.load.grpcload``).

N coroutines on one channel, each sending ``ModelInfer`` with the row as raw contents as soon as
its last answer came, for a fixed time; one JSON line out (``bench.load.loops.LoadResult``). The
inputs are prepared once, so the client's CPU goes to gRPC and protobuf, not to numpy. Every
call has a deadline, so a stuck server costs at most ``seconds + timeout``.
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


def run(url: str, model: str, inputs: Path, concurrency: int, seconds: float) -> LoadResult:
    """The generator in a child process: ``inputs`` (an .npz) sent to ``model`` at ``url``."""
    args = ["--url", url, "--model", model, "--inputs", str(inputs)]
    args += ["--concurrency", str(concurrency), "--seconds", f"{seconds:g}"]
    return run_child("bench.load.grpcload", args, timeout_s=seconds + 120)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.load.grpcload", description=__doc__)
    opts = options.Options(parser)
    opts.add("url", required=True, help="host:port of the gRPC server")
    opts.add("model", required=True)
    opts.own("--inputs", required=True, type=Path, help=".npz of the request's inputs")
    opts.add("concurrency", required=True)
    opts.add("seconds", default=5.0)
    args = parser.parse_args()
    if args.concurrency < 1 or args.seconds <= 0:
        sys.exit("--concurrency must be >= 1 and --seconds > 0")
    with np.load(args.inputs) as data:
        inputs = {name: data[name] for name in data.files}
    result = asyncio.run(closed_loop(args.url, args.model, inputs, args.concurrency, args.seconds))
    result.print_line()


if __name__ == "__main__":
    main()
