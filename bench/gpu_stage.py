"""``python -m bench.gpu_stage``: a stage's and a split part's compute on a GPU under Keras-JAX
(no TensorFlow, no Ray), time per batch and peak device memory against the memory plan (issue
42, item 7).

The stage is an MLP of ``--layers`` ``Dense(--width)`` layers (random weights, built in code);
the part is its last layer split by output units into ``--parts`` (one part's columns: Megatron's
column-parallel slice). Each is jitted (``stateless_call``), warmed once, then run ``--batches``
times at ``--batch`` rows; the device's ``peak_bytes_in_use`` (``jax`` ``memory_stats``, the
allocator's high-water mark, preallocation off) is read after each.

The planned figure is made as ``shards plan`` makes it: weights + the activations live at the
stage's worst point at ``--batch`` rows (``shards.partition.memory_plan.MemoryModel`` over
``shards.partition.graph.analyse`` where those import without TensorFlow, else recomputed here
for the chain: the held input + the largest adjacent pair of layer outputs; the JSON says which)
+ the GPU overhead the plan assumes (``GPU_OVERHEAD_BYTES``; the CUDA context, which the
allocator's peak does not count, so the ratio is against weights + activations).

    KERAS_BACKEND=jax PYTHONPATH=. python -m bench.gpu_stage --width 4096 --layers 8 --batch 256

Without JAX or without a GPU it says so and exits 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import Any

NO_DEVICE = 2
MiB = 1 << 20


def _jax_gpu() -> Any:
    """The first GPU JAX sees; exits with the reason where there is none."""
    try:
        import jax
    except ImportError:
        _leave("JAX is not installed (pip install 'jax[cuda12]'); this bench runs on a GPU only")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        _leave(f"no GPU visible to JAX (devices: {jax.devices()}); this bench runs on a GPU only")
    return gpus[0]


def _leave(reason: str) -> Any:
    print(f"bench.gpu_stage: {reason}", file=sys.stderr)
    raise SystemExit(NO_DEVICE)


def build_stage(width: int, layers: int, units: int | None = None) -> Any:
    """The stage: ``layers`` Dense(width) with relu; the last one ``units`` wide when given (a
    part's columns)."""
    import keras

    x = inputs = keras.Input((width,), name="x")
    for i in range(layers):
        last = i == layers - 1
        x = keras.layers.Dense(
            units if last and units else width,
            activation=None if last else "relu",
            name=f"dense_{i}",
        )(x)
    return keras.Model(inputs, x, name="stage")


def recomputed_plan(model: Any, rows: int) -> dict[str, int]:
    """Weights and activations of a chain of layers as the memory plan counts them: the input
    is held for the whole call; a layer's output lives until the next layer has read it, the
    last to the end of the stage. Float32 throughout."""
    weights = sum(int(_count(w.shape)) * 4 for w in model.weights)
    sizes = [int(_count(model.inputs[0].shape[1:]))] + [
        int(_count(layer.output.shape[1:])) for layer in model.layers[1:]
    ]
    held, outs = sizes[0], sizes[1:]
    pairs = [outs[0]] + [a + b for a, b in itertools.pairwise(outs)]
    return {"weight_bytes": weights, "activation_bytes": (held + max(pairs)) * 4 * rows}


def _count(shape: Any) -> int:
    total = 1
    for d in shape:
        total *= int(d)
    return total


def planned(model: Any, rows: int) -> dict[str, Any]:
    """The plan's figures for ``model`` at ``rows``: shards' own where it imports without
    TensorFlow, else recomputed (``plan_source`` says which)."""
    try:
        from shards.partition.graph import analyse
        from shards.partition.memory_plan import MemoryModel

        graph = analyse(model)
        need = MemoryModel(graph, rows, 0).need(0, len(graph.nodes))
        figures = {"weight_bytes": need.weight_bytes, "activation_bytes": need.activation_bytes}
        source = "shards.partition.memory_plan"
    except Exception as exc:  # a chain the helpers cannot read under this backend
        figures, source = recomputed_plan(model, rows), f"recomputed ({type(exc).__name__})"
    if "tensorflow" in sys.modules:
        figures, source = recomputed_plan(model, rows), "recomputed (shards' plan pulls TF)"
    from shards.partition.memory_plan import GPU_OVERHEAD_BYTES

    return {**figures, "overhead_bytes": GPU_OVERHEAD_BYTES, "plan_source": source}


def measure(device: Any, model: Any, rows: int, batches: int) -> dict[str, Any]:
    import jax
    import numpy as np

    trainable = [jax.device_put(v.value, device) for v in model.trainable_variables]
    frozen = [jax.device_put(v.value, device) for v in model.non_trainable_variables]
    width = int(model.inputs[0].shape[-1])
    x = jax.device_put(np.random.default_rng(0).standard_normal((rows, width), "float32"), device)
    call = jax.jit(lambda t, n, a: model.stateless_call(t, n, a, training=False)[0])
    call(trainable, frozen, x).block_until_ready()  # compile and warm
    times = []
    for _ in range(batches):
        tick = time.perf_counter()
        call(trainable, frozen, x).block_until_ready()
        times.append(time.perf_counter() - tick)
    stats = device.memory_stats() or {}
    times.sort()
    return {
        "ms_per_batch_p50": round(times[len(times) // 2] * 1000, 3),
        "ms_per_batch_min": round(times[0] * 1000, 3),
        "peak_bytes_in_use": int(stats.get("peak_bytes_in_use", 0)),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = _jax_gpu()
    report: dict[str, Any] = {"device": str(device), "batch": args.batch}
    shapes = {"stage": None, f"part 0 of {args.parts}": args.width // args.parts}
    for label, units in shapes.items():
        model = build_stage(args.width, args.layers, units)
        plan = planned(model, args.batch)
        got = measure(device, model, args.batch, args.batches)
        counted = plan["weight_bytes"] + plan["activation_bytes"]
        report[label] = {
            **got,
            **plan,
            "planned_mib": round(counted / MiB, 1),
            "peak_mib": round(got["peak_bytes_in_use"] / MiB, 1),
            "peak_over_plan": round(got["peak_bytes_in_use"] / counted, 3) if counted else None,
        }
    report["tensorflow_imported"] = "tensorflow" in sys.modules
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_stage", description=__doc__)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--parts", type=int, default=2)
    args = parser.parse_args(argv)
    # Before Keras is imported: JAX computes; the allocator's peak is what the stage used.
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
