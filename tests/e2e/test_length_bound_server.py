"""A keras_hub BERT of 32 positions, served with no length flag (issue 27, item 2): before, every
stage actor died at its warm-up at length 512 (``Expected size[0] in [0, 32], but got 512``).
Now it loads at its own bound: a row of 32 tokens is answered as the whole model answers it, one
of 33 gets a 400 naming 32, and its length buckets end at 32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.serverproc import Server, running_server
from tests.shards.model_zoo import small_bert

POSITIONS = 32


def _row(length: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(length)
    return {
        "token_ids": rng.integers(1, 100, size=length).tolist(),
        "segment_ids": [0] * length,
        "padding_mask": [1] * length,
    }


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """The model saved as a user would (a ``.keras`` file) and its answer to a 32-token row."""
    import keras

    keras.utils.set_random_seed(27)
    model = small_bert(POSITIONS, num_layers=2)
    path = tmp_path_factory.mktemp("bert") / "bert.keras"
    model.save(path)
    row = {k: np.asarray([v], dtype="int32") for k, v in _row(POSITIONS).items()}
    pooled = keras.ops.convert_to_numpy(model(row, training=False)["pooled_output"])[0]
    return path, pooled


@pytest.fixture(scope="module")
def bert_server(
    tmp_path_factory: pytest.TempPathFactory, ray_address: str, bert: tuple[Path, np.ndarray]
) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("bert-server")
    args = [
        "--model", str(bert[0]),
        "--import", "keras_hub",
        "--stages", "2",
        "--ray-address", ray_address,
        "--cache-dir", str(workdir / "cache"),
        "--max-batch-size", "4",
    ]  # fmt: skip
    with running_server(args, workdir) as server:
        yield server


def test_a_32_position_bert_is_served_up_to_32_with_no_length_flag(
    bert_server: Server, bert: tuple[Path, np.ndarray]
) -> None:
    url = f"{bert_server.url}/v1/models/bert:predict"
    ok = httpx.post(url, json={"instances": [_row(POSITIONS)]}, timeout=60)
    assert ok.status_code == 200, ok.text
    pooled = np.asarray(ok.json()["predictions"][0]["pooled_output"], dtype=np.float32)
    np.testing.assert_allclose(pooled, bert[1], atol=1e-4, rtol=0)

    long = httpx.post(url, json={"instances": [_row(POSITIONS + 1)]}, timeout=60)
    assert long.status_code == 400
    assert "length 33 in dimension 1 is over max_sequence_length=32" in long.json()["error"]

    meta = httpx.get(f"{bert_server.url}/v2/models/bert", timeout=10).json()
    assert meta["parameters"]["length_padding"]["buckets"] == [16, POSITIONS]
    assert "at length 512" not in bert_server.output()
