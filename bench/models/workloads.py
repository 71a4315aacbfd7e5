"""The models every system serves, saved once to ``.keras`` files, and the request bodies.

- heavy: 1024 floats -> 8 x Dense(2048) -> 10 (31.5M parameters): batching pays ~9x on CPU.
- light: 64 -> 64 -> 10: the model is nearly free, so the serving path itself is measured.
- conv:  a small residual convolutional net on 32x32x3 images (``shards.partition.demo_models.demo_resnet``).

Keras is imported only inside ``build``/``ensure_saved``, so the harness driver stays light.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import orjson

from bench.systems.base import subprocess_env

if TYPE_CHECKING:
    import keras


@dataclass(frozen=True)
class Workload:
    name: str
    row_shape: tuple[int, ...]
    about: str

    def request_body(self, rows: int = 1, seed: int = 0) -> bytes:
        """A TF-Serving row-form body that every system under test accepts unchanged."""
        rng = np.random.default_rng(seed)
        batch = np.round(rng.standard_normal((rows, *self.row_shape)).astype(np.float32), 4)
        return orjson.dumps({"instances": batch.tolist()})

    def sample(self, rows: int) -> np.ndarray:
        rng = np.random.default_rng(rows)
        return rng.standard_normal((rows, *self.row_shape)).astype(np.float32)


WORKLOADS: dict[str, Workload] = {
    "heavy": Workload("heavy", (1024,), "1024 -> 8 x Dense(2048) -> 10, 31.5M parameters"),
    "light": Workload("light", (64,), "64 -> 64 -> 10, 4.8k parameters"),
    "conv": Workload("conv", (32, 32, 3), "residual CNN on 32x32x3 (demo-resnet), 0.18M params"),
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; expected one of {sorted(WORKLOADS)}"
        ) from None


def build(name: str) -> keras.Model:
    import keras

    from shards.partition.demo_models import demo_mlp, demo_resnet

    if name == "heavy":
        return demo_mlp()
    if name == "conv":
        return demo_resnet()
    if name == "light":
        init = keras.initializers.GlorotUniform(seed=7)
        features = keras.Input((64,), name="features")
        hidden = keras.layers.Dense(64, activation="relu", kernel_initializer=init, name="h")(
            features
        )
        logits = keras.layers.Dense(10, kernel_initializer=init, name="logits")(hidden)
        return keras.Model(features, logits, name="light")
    get_workload(name)  # raises with the list of names
    raise AssertionError(name)


def ensure_saved(
    name: str, directory: Path, builder: Callable[[str], keras.Model] | None = None
) -> Path:
    """The workload's ``.keras`` file under ``directory``, built (by ``builder``, else
    ``build``) and saved on first use; written aside and renamed, so it appears whole."""
    path = Path(directory) / f"{name}.keras"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial.keras")
        (builder or build)(name).save(tmp)
        tmp.rename(path)
    return path


def save_workload(name: str, workdir: Path) -> Path:
    """Build and save the ``.keras`` file in a child process: the driver never loads TensorFlow."""
    code = "import sys; from bench.models.workloads import ensure_saved; print(ensure_saved(*sys.argv[1:]))"
    out = subprocess.run(
        [sys.executable, "-c", code, name, str(workdir / "models")],
        capture_output=True,
        text=True,
        env=subprocess_env(),
    )
    if out.returncode != 0:
        raise RuntimeError(f"saving workload {name!r} failed: {out.stderr[-1500:]}")
    return Path(out.stdout.strip().splitlines()[-1])
