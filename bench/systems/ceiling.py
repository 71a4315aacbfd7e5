"""The model's own ceiling: the ``.keras`` file called directly, no serving at all.

``python -m bench.systems.ceiling --model M --batch-sizes 1,64 --seconds 5`` prints one JSON
line: per batch size, the median ms per call, rows/s and the CPU per row (the process's CPU
time over the rows computed: what a shard actor's CPU per row is held against). It runs in a
subprocess of its own so that the harness driver never loads TensorFlow, and it uses TensorFlow's default thread pool
(all cores): the best this model does on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench import options
from bench.systems.base import subprocess_env


def measure(model_path: str, batch_sizes: list[int], seconds: float) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    model = keras.saving.load_model(model_path, compile=False)
    spec = tf.TensorSpec((None, *model.input_shape[1:]), tf.float32)
    step = tf.function(lambda x: model(x, training=False), input_signature=[spec])
    results: dict[str, Any] = {}
    for size in batch_sizes:
        x = np.random.default_rng(size).standard_normal((size, *model.input_shape[1:]))
        x = x.astype(np.float32)
        for _ in range(3):  # trace and warm the caches
            np.asarray(step(x))
        times: list[float] = []
        end = time.perf_counter() + seconds
        cpu = time.process_time()  # every thread of this process: TensorFlow's pool included
        while time.perf_counter() < end or len(times) < 5:
            tick = time.perf_counter()
            np.asarray(step(x))
            times.append(time.perf_counter() - tick)
        cpu_ms_per_row = (time.process_time() - cpu) * 1000.0 / (size * len(times))
        ms = statistics.median(times) * 1000.0
        results[str(size)] = {
            "ms": ms,
            "rows_per_s": size / (ms / 1000.0),
            "calls": len(times),
            "cpu_ms_per_row": cpu_ms_per_row,
        }
    return results


def measure_ceiling(model: Path, batch_sizes: Sequence[int], seconds: float) -> dict[str, Any]:
    """The ceiling measured in a child process: the driver never loads TensorFlow."""
    argv = [sys.executable, "-m", "bench.systems.ceiling", "--model", str(model)]
    argv += ["--batch-sizes", ",".join(map(str, batch_sizes)), "--seconds", f"{seconds:g}"]
    out = subprocess.run(argv, capture_output=True, text=True, env=subprocess_env())
    if out.returncode != 0:
        raise RuntimeError(f"ceiling of {model} failed: {out.stderr[-1500:]}")
    return dict(orjson.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.systems.ceiling", description=__doc__)
    opts = options.Options(parser)
    opts.add("model", required=True, help="a .keras file")
    opts.own("--batch-sizes", default="1,64")
    opts.add("seconds", default=5.0, help="per batch size")
    args = parser.parse_args()
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        sys.exit(f"--batch-sizes must be integers >= 1, got {args.batch_sizes!r}")
    sys.stdout.write(orjson.dumps(measure(args.model, sizes, args.seconds)).decode() + "\n")


if __name__ == "__main__":
    main()
