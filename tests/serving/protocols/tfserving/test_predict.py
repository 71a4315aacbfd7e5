"""TF-Serving's predict route with rows of different lengths: a ragged ``instances`` body is
answered row by row, each row at its own length, with or without length padding; refused with
the row named where the model takes no unknown length or a row is over max_sequence_length."""

from __future__ import annotations

import numpy as np

from serving.batching.lengths import LengthPadding, length_buckets
from shards.signature import ModelSignature, TensorSpec
from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner
from tests.serving.served_app import serve

LIMIT = 32
ECHO = ModelSignature(
    name="fake",
    inputs=(TensorSpec("ids", (None,), "int32"),),
    outputs=(TensorSpec("length", (), "float32"), TensorSpec("echo", (None,), "float32")),
)


class LengthEcho(FakeRunner):
    """Per row: how many ids are not the pad value 0, and the ids themselves (per token), so
    that an answer shows the length the row was served at."""

    async def run_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        await super().run_batch(inputs)
        ids = inputs["ids"]
        return {
            "length": (ids != 0).sum(axis=1).astype(np.float32),
            "echo": ids.astype(np.float32),
        }


ROWS = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
ANSWER = {
    "predictions": [
        {"length": 3.0, "echo": [1.0, 2.0, 3.0]},
        {"length": 1.0, "echo": [4.0]},
        {"length": 5.0, "echo": [5.0, 6.0, 7.0, 8.0, 9.0]},
    ]
}


async def test_a_ragged_instances_body_is_answered_row_by_row() -> None:
    runner = LengthEcho(ECHO)
    async with serve(runner, max_sequence_length=LIMIT, batch_timeout_ms=0) as client:
        batcher = client.shardserve.model().batcher  # type: ignore[attr-defined]
        assert batcher is not None
        batcher.set_length_padding(None)
        r = await client.post("/v1/models/fake:predict", json={"instances": ROWS})
        assert r.status_code == 200, r.text
        assert r.json() == ANSWER
        # Rectangular rows of a model of unknown length still go as one stacked request.
        before = len(runner.batches)
        same = await client.post("/v1/models/fake:predict", json={"instances": [[1, 2], [3, 4]]})
        assert same.json()["predictions"][1] == {"length": 2.0, "echo": [3.0, 4.0]}
        assert [b["ids"].shape for b in runner.batches[before:]] == [(2, 2)]

        # With length padding the rows share one batch, padded to a bucket, and are cut back.
        batcher.set_length_padding(
            LengthPadding(
                axes={"ids": 1},
                pad_values={"ids": 0},
                buckets=length_buckets(LIMIT),
                output_axes={"echo": 1},
            )
        )
        before = len(runner.batches)
        padded = await client.post("/v1/models/fake:predict", json={"instances": ROWS})
        assert padded.status_code == 200, padded.text
        assert padded.json() == ANSWER
        assert [b["ids"].shape for b in runner.batches[before:]] == [(3, 16)]


async def test_a_ragged_row_over_the_max_sequence_length_is_refused_by_its_index() -> None:
    runner = LengthEcho(ECHO)
    async with serve(runner, max_sequence_length=LIMIT, batch_timeout_ms=0) as client:
        before = len(runner.batches)
        body = {"instances": [[1], list(range(1, LIMIT + 1)), list(range(1, LIMIT + 2))]}
        r = await client.post("/v1/models/fake:predict", json=body)
        assert r.status_code == 400
        assert (
            f"instance 2 of input 'ids' has length {LIMIT + 1} (row shape ({LIMIT + 1},)), "
            f"over max_sequence_length={LIMIT}" in r.json()["error"]
        )
        assert_clean_error(r.json())
        assert len(runner.batches) == before  # nothing of the request ran


async def test_ragged_rows_for_a_model_of_fixed_shape_are_refused_by_their_index() -> None:
    async with serve(FakeRunner(), batch_timeout_ms=0) as client:
        body = {"instances": [[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]}
        r = await client.post("/v1/models/fake:predict", json=body)
    assert r.status_code == 400
    assert r.json()["error"].startswith(
        "instance 1 of input 'x' has shape (7,); the model takes (n, 4) float32: every row the "
        "same shape"
    )
