"""``python -m bench.split_ids``: whether a routed lookup part should get only the ids in its
range (issue 42, item 2's send half) instead of every id of the batch, as it does.

Today the driver puts each id tensor in the object store once (``ray.put``: a request tensor
that several stages read) and every part reads it: it checks every id against the whole
vocabulary (an id outside it fails as the whole table's lookup does) and keeps those in its
range. The other way: the driver splits each id tensor by the parts' ranges and sends part k its
ids and their positions (the combine needs the positions; the out-of-vocabulary check moves to
the driver). Printed as JSON, for a batch of ``--batch`` rows of ``--ids`` ids each (uniform,
so each part finds 1/parts of them) and a table of ``--dim`` float32 columns:

- the bytes each way puts in the object store (the driver's writes) and the parts read, and the
  bytes a routed part writes (vectors and positions), against which the ids' share is read;
- the driver's time to split a batch's ids (numpy: the check, then a mask per part), and a
  routed part's time (traced, as a stage runs) to look up all the ids against only its own,
  measured side by side, run after run (medians of ``--repeats`` runs of ``--number`` calls,
  and the median of the runs' ratios).

    PYTHONPATH=. python -m bench.split_ids --batch 32 --ids 21 --dim 32 --parts 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import timeit
from typing import Any

import numpy as np


def byte_counts(batch: int, ids: int, dim: int, parts: int) -> dict[str, int]:
    """Per batch: today every part reads the one copy of the ids; split, each part gets its ids
    and their positions (int32 each), which the driver writes."""
    n = batch * ids
    return {
        "driver_writes_all_ids": 4 * n,
        "parts_read_all_ids": parts * 4 * n,
        "driver_writes_split_ids": 8 * n,
        "parts_read_split_ids": 8 * n,
        "parts_write_routed": n * (4 * dim + 4),
    }


def _split(ids: np.ndarray, bounds: list[int], vocabulary: int) -> list[tuple[Any, Any]]:
    flat = ids.reshape(-1)
    flat = np.where(flat < 0, flat + vocabulary, flat)
    if ((flat < 0) | (flat >= vocabulary)).any():
        raise ValueError("an id outside the vocabulary")
    out = []
    for a, b in itertools.pairwise(bounds):
        at = np.nonzero((flat >= a) & (flat < b))[0].astype("int32")
        out.append((flat[at] - a, at))
    return out


def timings(
    batch: int, ids: int, dim: int, parts: int, number: int, repeats: int
) -> dict[str, float]:
    import keras

    from shards.split import TableRows, bounds_for

    vocabulary = 6000
    rng = np.random.default_rng(0)
    batch_ids = rng.integers(0, vocabulary, size=(batch, ids)).astype("int32")
    bounds = list(bounds_for(vocabulary, parts))
    part = TableRows(0, bounds[1], dim, vocabulary, routed=True)
    part.build(None)
    own = TableRows(0, bounds[1], dim, None, routed=True)  # no check: its ids are in range
    own.build(None)
    mine = _split(batch_ids, bounds, vocabulary)[0][0]
    mine = mine.reshape(1, -1)

    import tensorflow as tf

    # As a stage actor runs its stage: a traced function over any batch of ids.
    spec = [tf.TensorSpec((None, None), tf.int32)]
    all_ids = tf.function(lambda x: part([x]), input_signature=spec)
    own_ids = tf.function(lambda x: own([x]), input_signature=spec)

    def per_call_us(fn: Any) -> float:
        return 1e6 * timeit.timeit(fn, number=number) / number

    def all_call() -> Any:
        return keras.ops.convert_to_numpy(all_ids(batch_ids)[0])

    def own_call() -> Any:
        return keras.ops.convert_to_numpy(own_ids(mine)[0])

    all_call(), own_call()
    split, every, only = [], [], []
    # Side by side, run after run: the machine's load falls on both.
    for _ in range(repeats):
        split.append(per_call_us(lambda: _split(batch_ids, bounds, vocabulary)))
        every.append(per_call_us(all_call))
        only.append(per_call_us(own_call))
    return {
        "driver_split_us": statistics.median(split),
        "part_all_ids_us": statistics.median(every),
        "part_own_ids_us": statistics.median(only),
        "part_own_over_all": statistics.median(o / e for o, e in zip(only, every, strict=True)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.split_ids", description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ids", type=int, default=21, help="ids per row (a history and an item)")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--parts", type=int, default=2)
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    found: dict[str, Any] = byte_counts(args.batch, args.ids, args.dim, args.parts)
    found |= timings(args.batch, args.ids, args.dim, args.parts, args.number, args.repeats)
    print(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
