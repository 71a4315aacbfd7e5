"""``python -m bench.partition_peak``: the partitioner's host peak when it splits a large table
(issue 42, item 4). The goal: at most the model plus one part above the process's memory before
the partition (a part's weights are read out of the table only as its stage is written:
``shards.split.views``).

Each measurement runs in a process of its own: it builds an ``Embedding(rows, dim)`` model with a
small head, reads its RSS, partitions it under a budget that splits the table into ``--parts``
parts, and reads the peak RSS (the high-water mark of the whole process, reset after
the build where Linux lets it: ``VmHWM`` after ``clear_refs``). Printed
as JSON: the model's and a part's bytes, the RSS before, the peak, and the peak over the RSS
before (which holds the model) in models: the goal is one part (1/parts); the parts held beside
the model at once are one model (1.0); a copy of the whole table per part on top is more.

The table's random values are drawn by numpy a block at a time and handed to Keras as the
initial value (``--initializer numpy``, the default), so the process holds the table and
nothing else of its making: TensorFlow's allocator keeps what it freed for its next tensors, and
Keras's own random initializer (``--initializer keras``) leaves ~2 models of such free memory
behind, in which the partitioner's own tensors then fit without raising the RSS.

``--kind dense`` measures a ``Dense`` of ``--rows`` inputs and ``--dim`` units split by columns
instead (a part's columns are a copy of them, where a table's rows are not).

``--compare-tree DIR`` measures the same with the ``shards`` package of another checkout (this
file's measuring code in both), that tree first, then this one: the figures side by side.

    PYTHONPATH=. python -m bench.partition_peak --rows 1000000 --dim 256 --parts 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MiB = 1 << 20
# Rows of random values drawn at a time.
_BLOCK_ROWS = 65536


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Reset the process's peak RSS to its RSS now (Linux ``clear_refs``): building the table
    peaked over the model (numpy's values and TensorFlow's copy of them)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_bytes() -> int:
    """The process's peak RSS since it started, or since ``_reset_peak`` (``VmHWM``)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _load() -> float:
    with open("/proc/loadavg", encoding="ascii") as f:
        return float(f.read().split()[0])


def _table_values(rows: int, dim: int) -> Any:
    import numpy as np

    rng = np.random.default_rng(0)
    values = np.empty((rows, dim), dtype="float32")
    for start in range(0, rows, _BLOCK_ROWS):
        block = values[start : start + _BLOCK_ROWS]
        block[...] = rng.uniform(-0.05, 0.05, block.shape)
    return values


def measure(
    rows: int, dim: int, parts: int, initializer: str = "numpy", kind: str = "table"
) -> dict[str, Any]:
    """In this process: build, read the RSS, partition, read the peak."""
    import keras

    from shards.partition.cut import partition_to_bundle

    init: Any = "uniform"
    if initializer == "numpy":
        values = [_table_values(rows, dim)]

        def init(shape: Any, dtype: Any = None) -> Any:
            return values.pop()

    if kind == "dense":
        # A Dense of ``rows`` inputs and ``dim`` units, split by columns (units).
        x = keras.Input((rows,), name="x")
        y = keras.layers.Dense(dim, kernel_initializer=init, name="table")(x)
        model = keras.Model(x, y, name="big_dense")
    else:
        ids = keras.Input((4,), dtype="int32", name="ids")
        x = keras.layers.Embedding(rows, dim, embeddings_initializer=init, name="table")(ids)
        x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
        model = keras.Model(ids, keras.layers.Dense(1, name="score")(x), name="big_table")
    table = rows * dim * 4
    # Each part a little over its share of the table (the activations at batch 1 are tiny).
    budget = table // parts + table // (4 * parts)
    peak_before = _peak_bytes()
    reset = _reset_peak()
    before = _rss_bytes()
    with tempfile.TemporaryDirectory() as out:
        manifest = partition_to_bundle(
            model,
            Path(out) / "b",
            max_stage_bytes=budget,
            plan_batch_rows=1,
            device_overhead_bytes=0,
        )
    peak = _peak_bytes()
    split = [s for s in manifest.splits() if s["layer"] == "table"]
    made = split[0]["parts"] if split else 1
    return {
        "kind": kind,
        "rows": rows,
        "dim": dim,
        "parts": made,
        "initializer": initializer,
        "model_mib": table / MiB,
        "part_mib": table / made / MiB,
        "rss_before_mib": before / MiB,
        "peak_before_mib": peak_before / MiB,
        "peak_reset": reset,
        "peak_mib": peak / MiB,
        "peak_over_before_mib": (peak - before) / MiB,
        "peak_over_before_in_models": round((peak - before) / table, 3),
        "goal_in_models": round(1 / made, 3),
    }


def _run(args: argparse.Namespace, tree: Path | None) -> dict[str, Any]:
    """One measurement in a process of its own, ``shards`` from ``tree`` (None: this one)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--inline"]
    command += ["--rows", str(args.rows), "--dim", str(args.dim), "--parts", str(args.parts)]
    command += ["--initializer", args.initializer, "--kind", args.kind]
    root = Path(__file__).resolve().parents[1]
    env = os.environ | {"PYTHONPATH": str((tree or root).resolve())}
    load = _load()
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"tree": str(tree or root), **result, "load_1m": [load, _load()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--initializer", choices=("numpy", "keras"), default="numpy")
    parser.add_argument(
        "--kind",
        choices=("table", "dense"),
        default="table",
        help="table: an Embedding of --rows x --dim split by rows; dense: a Dense of --rows "
        "inputs and --dim units split by columns",
    )
    parser.add_argument("--compare-tree", type=Path, help="a checkout to measure first, alike")
    parser.add_argument("--inline", action="store_true", help="measure in this process")
    args = parser.parse_args()
    if args.inline:
        print(json.dumps(measure(args.rows, args.dim, args.parts, args.initializer, args.kind)))
        return
    if args.compare_tree is None:
        print(json.dumps(_run(args, None)))
        return
    other, this = _run(args, args.compare_tree), _run(args, None)
    print(json.dumps(other))
    print(json.dumps(this))
    key = "peak_over_before_mib"
    ratio = this[key] / other[key] if other[key] > 0 else float("nan")
    print(json.dumps({"peak_over_before_this_over_other": round(ratio, 3)}))


if __name__ == "__main__":
    main()
