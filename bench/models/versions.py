"""The versions of one token model that the rollout bench swaps: one signature, four kinds.

Every kind takes ``ids`` (4 token ids, int32) and answers 3 scores, so each can follow another
as a version of the same model:

- light:  Embedding(10, 8) -> Flatten -> Dense(3): the model is nearly free.
- heavy:  Embedding(10, 256) -> Flatten -> 4 x Dense(2048) -> Dense(3), 14.7M parameters
  (59 MB): a load that takes the cores a while, and ~ms of compute per row.
- slow:   Embedding -> Dense(1024) -> a 32x32 map -> ``layers`` x Conv2D(32, 3x3) -> Dense(3):
  few weights, much compute per row (the "slower canary").
- broken: Embedding(3, 8): an id of 3 or more makes TensorFlow raise on CPU, so a row of 4
  ids drawn from [0, 10) fails 99% of the time (the model raised: 422).

``python -m bench.models.versions --dir D --kind K [--layers L]`` saves ``D/K.keras`` (on first
use) and prints one JSON line: its path and the median time of a one-row call, in ms. It runs
in a child process so that the bench driver never loads TensorFlow.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from bench.systems.base import subprocess_env

if TYPE_CHECKING:
    import keras

KINDS = ("light", "heavy", "slow", "broken")
VOCAB = 10
ROW_LEN = 4
INPUT_NAME = "ids"


def build(kind: str, layers: int = 40) -> keras.Model:
    import keras

    keras.utils.set_random_seed(11)
    ids = keras.Input((ROW_LEN,), dtype="int32", name=INPUT_NAME)
    if kind in ("light", "broken"):
        h = keras.layers.Embedding(VOCAB if kind == "light" else 3, 8)(ids)
        h = keras.layers.Flatten()(h)
    elif kind == "heavy":
        h = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 256)(ids))
        for _ in range(4):
            h = keras.layers.Dense(2048, activation="relu")(h)
    elif kind == "slow":
        h = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 16)(ids))
        h = keras.layers.Reshape((32, 32, 1))(keras.layers.Dense(1024)(h))
        for _ in range(layers):
            h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
    else:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {KINDS}")
    out = keras.layers.Dense(3, name="scores")(h)
    return keras.Model(ids, out, name=f"tokens_{kind}")


def file_name(kind: str, layers: int) -> str:
    return f"{kind}-{layers}.keras" if kind == "slow" else f"{kind}.keras"


def save_and_time(directory: Path, kind: str, layers: int) -> dict[str, Any]:
    import keras

    path = directory / file_name(kind, layers)
    if not path.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial.keras")
        build(kind, layers).save(tmp)
        tmp.rename(path)
    model = keras.saving.load_model(path, compile=False)
    row = np.zeros((1, ROW_LEN), dtype=np.int32)  # id 0 is valid for every kind
    model(row)
    times = []
    for _ in range(7):
        tick = time.perf_counter()
        model(row)
        times.append((time.perf_counter() - tick) * 1000.0)
    return {"path": str(path), "row_ms": float(np.median(times))}


def ensure_model(directory: Path, kind: str, layers: int = 40) -> dict[str, Any]:
    """Save (in a child process) and time one kind: {"path", "row_ms"}."""
    argv = [sys.executable, "-m", "bench.models.versions", "--dir", str(directory)]
    argv += ["--kind", kind, "--layers", str(layers)]
    out = subprocess.run(argv, capture_output=True, text=True, env=subprocess_env())
    if out.returncode != 0:
        raise RuntimeError(f"building the {kind} model failed: {out.stderr[-1500:]}")
    return dict(orjson.loads(out.stdout.strip().splitlines()[-1]))


def rows(n: int, seed: int) -> np.ndarray:
    """``n`` rows of token ids drawn from [0, 10), seeded."""
    return np.random.default_rng(seed).integers(0, VOCAB, size=(n, ROW_LEN)).astype(np.int32)


def v2_body(row: np.ndarray) -> bytes:
    """A KServe V2 infer body of one row (its answer names the version that ran it)."""
    tensor = {"name": INPUT_NAME, "shape": [1, ROW_LEN], "datatype": "INT32"}
    return orjson.dumps({"inputs": [{**tensor, "data": [int(v) for v in row]}]})


def v2_bodies(n: int, seed: int) -> list[bytes]:
    return [v2_body(row) for row in rows(n, seed)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--layers", type=int, default=40, help="the slow kind's Conv2D layers")
    args = parser.parse_args()
    print(orjson.dumps(save_and_time(args.dir, args.kind, args.layers)).decode())


if __name__ == "__main__":
    main()
