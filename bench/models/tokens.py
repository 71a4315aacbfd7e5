"""The chaos bench's model and its expected answers, computed here and never by the server.

Token ids (4 per row, int32) -> Embedding(10, 8) -> Flatten -> Dense(3). An id outside [0, 10)
makes TensorFlow raise on CPU, so a row holding one is a real poisoned input.

``python -m bench.models.tokens --dir D --rows rows.npy`` saves ``D/tokens.keras`` (on first use) and
writes ``D/expected.npy``: the saved model's own outputs for every row whose ids are in range,
NaN for the others. It runs in a child process so that the bench driver never loads TensorFlow.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import keras

VOCAB = 10
ROW_LEN = 4
OUTPUTS = 3
POISON_ID = 1000
MODEL_FILE = "tokens.keras"
EXPECTED_FILE = "expected.npy"


def build() -> keras.Model:
    import keras

    keras.utils.set_random_seed(5)
    ids = keras.Input((ROW_LEN,), dtype="int32", name="ids")
    h = keras.layers.Embedding(VOCAB, 8, name="embed")(ids)
    h = keras.layers.Flatten(name="flat")(h)
    out = keras.layers.Dense(OUTPUTS, name="scores")(h)
    return keras.Model(ids, out, name="tokens")


def in_range(rows: np.ndarray) -> np.ndarray:
    """One bool per row: every id is a valid token."""
    return np.all((rows >= 0) & (rows < VOCAB), axis=1)


def save_and_predict(directory: Path, rows: np.ndarray) -> np.ndarray:
    import keras

    path = directory / MODEL_FILE
    if not path.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f"partial-{MODEL_FILE}"
        build().save(tmp)
        tmp.rename(path)
    model = keras.saving.load_model(path, compile=False)
    expected = np.full((len(rows), OUTPUTS), np.nan, dtype=np.float32)
    good = in_range(rows)
    if good.any():
        expected[good] = np.asarray(model.predict(rows[good].astype(np.int32), verbose=0))
    return expected


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--rows", type=Path, required=True, help=".npy of (n, 4) token ids")
    args = parser.parse_args()
    expected = save_and_predict(args.dir, np.load(args.rows))
    np.save(args.dir / EXPECTED_FILE, expected)
    print(args.dir / MODEL_FILE)


if __name__ == "__main__":
    main()
