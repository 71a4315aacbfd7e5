"""``python -m bench.partition_peak``: the partitioner's host peak when it splits a large table
(issue 42, item 4). The goal: at most the model plus one part above the process's memory before
the partition (the parts' slices are read out of the table one at a time, never a copy of the
whole table per part).

Each measurement runs in a process of its own: it builds an ``Embedding(rows, dim)`` model with a
small head (random weights, built in code), reads its RSS, partitions it under a budget that
splits the table into ``--parts`` parts, and reads the peak RSS (``ru_maxrss``, the high-water
mark of the whole process). Printed as JSON: the model's and a part's bytes, the RSS before, the
peak, and the peak over the RSS before (which holds the model) in models: the goal is one part
(1/parts); the parts held beside the model at once are one model (1.0); a copy of the whole table
per part on top is more.

    PYTHONPATH=. python -m bench.partition_peak --rows 1000000 --dim 256 --parts 4
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 1 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


def measure(rows: int, dim: int, parts: int) -> dict[str, float]:
    """In this process: build, read the RSS, partition, read the peak."""
    import keras

    from shards.partition.cut import partition_to_bundle

    ids = keras.Input((4,), dtype="int32", name="ids")
    x = keras.layers.Embedding(rows, dim, name="table")(ids)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    model = keras.Model(ids, keras.layers.Dense(1, name="score")(x), name="big_table")
    table = rows * dim * 4
    # Each part a little over its share of the table (the activations at batch 1 are tiny).
    budget = table // parts + table // (4 * parts)
    before = _rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with tempfile.TemporaryDirectory() as out:
        manifest = partition_to_bundle(
            model,
            Path(out) / "b",
            max_stage_bytes=budget,
            plan_batch_rows=1,
            device_overhead_bytes=0,
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    split = [s for s in manifest.splits() if s["layer"] == "table"]
    made = split[0]["parts"] if split else 1
    return {
        "rows": rows,
        "dim": dim,
        "parts": made,
        "model_mib": table / MiB,
        "part_mib": table / made / MiB,
        "rss_before_mib": before / MiB,
        "peak_before_mib": peak_before / MiB,
        "peak_mib": peak / MiB,
        "peak_over_before_mib": (peak - before) / MiB,
        "peak_over_before_in_models": round((peak - before) / table, 3),
        "goal_in_models": round(1 / made, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--inline", action="store_true", help="measure in this process")
    args = parser.parse_args()
    if args.inline:
        print(json.dumps(measure(args.rows, args.dim, args.parts)))
        return
    command = [sys.executable, "-m", "bench.partition_peak", "--inline"]
    command += ["--rows", str(args.rows), "--dim", str(args.dim), "--parts", str(args.parts)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    print(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
