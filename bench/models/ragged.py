"""The ragged bench's models (issue 19): token models whose length is unknown, and their rows.

- ``demo-tokens``: ``shards.partition.demo_models`` (Embedding(mask_zero) -> masked pooling).
- ``bert``: a keras_hub ``BertBackbone`` built here: random weights (seeded), vocabulary 1000,
  2 layers, 2 heads, hidden 64, intermediate 128, sequences up to 128; inputs ``token_ids``,
  ``segment_ids`` and ``padding_mask``; outputs ``sequence_output`` (per token) and
  ``pooled_output``.
- ``demo-conv1d``: no mask (Conv1D + GlobalMaxPooling): its output changes under length padding,
  so the server must find that at warm-up and serve it unpadded.

Each is saved once to a ``.keras`` file under the workdir (``python -m bench.models.ragged save``)
and the answers the bench compares with are that file's own on each row alone (``predict``); both
run in child processes, so the bench driver never loads TensorFlow.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from bench.systems.base import subprocess_env

if TYPE_CHECKING:
    import keras

# One row of a request: the ids of a one-input model, or each named input's values.
Row = list[int] | dict[str, list[int]]
# The name a model's only output is compared under (an answer of one output has no names).
SINGLE = ""
# One row's answer: each output's values for that row (no batch dimension).
Answer = dict[str, np.ndarray]


@dataclass(frozen=True)
class RaggedModel:
    name: str
    vocab: int
    tolerance: float  # the largest difference from the row alone that counts as equal
    about: str
    bert_inputs: bool = False  # token_ids, segment_ids, padding_mask; else one input of ids

    def row(self, rng: np.random.Generator, length: int) -> Row:
        ids = [int(i) for i in rng.integers(1, self.vocab, length)]  # 0 is the pad id
        if not self.bert_inputs:
            return ids
        return {"token_ids": ids, "segment_ids": [0] * length, "padding_mask": [1] * length}


MODELS: dict[str, RaggedModel] = {
    "demo-tokens": RaggedModel(
        "demo-tokens", 100, 1e-5, "Embedding(100, 16, mask_zero) -> Dense -> masked mean -> 4"
    ),
    "bert": RaggedModel(
        "bert",
        1000,
        1e-4,
        "keras_hub BertBackbone, random weights, vocabulary 1000, 2 layers, 2 heads, hidden 64",
        bert_inputs=True,
    ),
    "demo-conv1d": RaggedModel(
        "demo-conv1d", 100, 1e-5, "Embedding(100, 16) -> Conv1D(16, 3) -> max pool -> 4, no mask"
    ),
}


def get_model(name: str) -> RaggedModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown ragged model {name!r}; expected one of {sorted(MODELS)}"
        ) from None


def lengths(n: int, low: int, high: int, seed: int) -> list[int]:
    """``n`` lengths drawn uniformly from ``low``..``high`` (both included), seeded."""
    if not 1 <= low <= high:
        raise ValueError(f"lengths need 1 <= low <= high, got {low}..{high}")
    return [int(x) for x in np.random.default_rng(seed).integers(low, high + 1, n)]


def rows(model: RaggedModel, row_lengths: list[int], seed: int) -> list[Row]:
    rng = np.random.default_rng(seed)
    return [model.row(rng, length) for length in row_lengths]


def body(request_rows: list[Row]) -> bytes:
    """A TF-Serving row-form body."""
    return orjson.dumps({"instances": request_rows})


def bert_backbone() -> keras.Model:
    import keras
    import keras_hub

    keras.utils.set_random_seed(19)
    return keras_hub.models.BertBackbone(
        vocabulary_size=1000,
        num_layers=2,
        num_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
        max_sequence_length=128,
    )


def build(name: str) -> keras.Model:
    from shards.partition.demo_models import build_demo

    get_model(name)  # raises with the list of names
    return bert_backbone() if name == "bert" else build_demo(name)


def ensure_saved(name: str, directory: Path) -> Path:
    """The model's ``.keras`` file under ``directory``, built and saved on first use."""
    from bench.models.workloads import ensure_saved as save_once

    return save_once(name, directory, build)


def _child(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "bench.models.ragged", *args],
        capture_output=True,
        text=True,
        env=subprocess_env(),
    )
    if out.returncode != 0:
        raise RuntimeError(f"bench.models.ragged {args[0]} failed: {out.stderr[-1500:]}")
    return out.stdout.strip().splitlines()[-1]


def save_model(name: str, workdir: Path) -> Path:
    """The model's ``.keras`` file under ``workdir/models``, saved by a child process."""
    return Path(_child("save", "--name", name, "--dir", str(workdir / "models")))


def expected_answers(model_path: Path, request_rows: list[Row], scratch: Path) -> list[Answer]:
    """The saved model's answer to each row alone, computed by a child process."""
    scratch.mkdir(parents=True, exist_ok=True)
    rows_file, out = scratch / "rows.json", scratch / "expected.npz"
    rows_file.write_bytes(orjson.dumps(request_rows))
    _child("predict", "--model", str(model_path), "--rows", str(rows_file), "--out", str(out))
    with np.load(out) as data:
        answers: list[Answer] = [{} for _ in request_rows]
        for key in data.files:
            index, _, name = key.partition("/")
            answers[int(index)][name] = data[key]
    return answers


def _predict(model_path: Path, request_rows: list[Row]) -> dict[str, np.ndarray]:
    import keras

    if importlib.util.find_spec("keras_hub") is not None:
        import keras_hub  # noqa: F401 - registers its layers for load_model

    model = keras.saving.load_model(model_path, compile=False)
    out: dict[str, np.ndarray] = {}
    for i, row in enumerate(request_rows):
        x: Any = (
            {k: np.asarray([v], dtype=np.int32) for k, v in row.items()}
            if isinstance(row, dict)
            else np.asarray([row], dtype=np.int32)
        )
        y = model(x, training=False)  # one row alone: a batch of 1 at its own length
        named = y if isinstance(y, dict) else {SINGLE: y}
        for name, value in named.items():
            out[f"{i}/{name}"] = np.asarray(keras.ops.convert_to_numpy(value))[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.models.ragged")
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="save a model's .keras file (once), print its path")
    save.add_argument("--name", required=True, choices=sorted(MODELS))
    save.add_argument("--dir", type=Path, required=True)
    predict = sub.add_parser("predict", help="each row alone through a saved model")
    predict.add_argument("--model", type=Path, required=True)
    predict.add_argument("--rows", type=Path, required=True, help="JSON list of rows")
    predict.add_argument("--out", type=Path, required=True, help=".npz written")
    args = parser.parse_args()
    if args.command == "save":
        print(ensure_saved(args.name, args.dir))
        return
    answers: dict[str, Any] = _predict(args.model, orjson.loads(args.rows.read_bytes()))
    np.savez(args.out, **answers)
    print(args.out)


if __name__ == "__main__":
    main()
