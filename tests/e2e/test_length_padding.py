"""Length padding with the demo token models: through a real server (the token model in 2
stages: requests of mixed lengths share batches, each answered as the row alone); and, to keep
to one server start (~15 s on 2 cores), the per-token tagger, the unmasked Conv1D model and
--no-pad-lengths through the app in process over the same Keras models run without Ray: the
tagger answered cut back to each length; the Conv1D model, opted in with --pad-input, found
unsafe at warm-up and served one queue per length, its answers exact."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest

from shards.signature import ModelSignature, TensorSpec
from tests.fakes import FakeRunner
from tests.metrics_text import metric
from tests.serverproc import Server, running_server
from tests.serving.served_app import serve

MAX_LENGTH = 64
LENGTHS = [3, 17, 9, 40, 1, 64, 25, 12]  # buckets 16, 32, 64


@pytest.fixture(scope="module")
def tokens_server(tmp_path_factory: pytest.TempPathFactory, ray_address: str) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("lengths")
    args = [
        "--model", "demo-tokens",
        "--stages", "2",
        "--ray-address", ray_address,
        "--cache-dir", str(workdir / "cache"),
        "--max-sequence-length", str(MAX_LENGTH),
        "--max-batch-size", "8",
        "--batch-timeout-ms", "200",
    ]  # fmt: skip
    with running_server(args, workdir) as server:
        yield server


def _rows(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 100, size=n).astype(np.int32) for n in lengths]


def _alone(model: str, rows: list[np.ndarray]) -> list[np.ndarray]:
    """Each row through the whole Keras model by itself: no padding, no batch-mates."""
    from shards.partition.demo_models import build_demo

    keras_model = build_demo(model)
    return [np.asarray(keras_model(row[None]))[0] for row in rows]


def _predict_concurrently(server: Server, model: str, rows: list[np.ndarray]) -> list[np.ndarray]:
    def one(row: np.ndarray) -> np.ndarray:
        body = {"instances": [row.tolist()]}
        r = httpx.post(f"{server.url}/v1/models/{model}:predict", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return np.asarray(r.json()["predictions"][0], dtype=np.float32)

    with ThreadPoolExecutor(len(rows)) as pool:
        return list(pool.map(one, rows))


def _metrics(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        "batches": metric(text, "shardserve_batch_size_rows_count"),
        "rows": metric(text, "shardserve_batch_size_rows_sum"),
        "real": metric(text, "shardserve_padded_positions_total", kind="real"),
        "pad": metric(text, "shardserve_padded_positions_total", kind="pad"),
    }


def _length_padding(server: Server, model: str) -> Any:
    meta = httpx.get(f"{server.url}/v2/models/{model}", timeout=10).json()
    return meta["parameters"]["length_padding"]


def test_mixed_lengths_share_batches_each_answered_as_alone(tokens_server: Server) -> None:
    assert _length_padding(tokens_server, "demo-tokens") == {
        "inputs": ["tokens"],
        "buckets": [16, 32, 64],
        "outputs_cut_back": [],
    }
    assert "length padding on for inputs ['tokens'] along their length" in tokens_server.output()
    rows = _rows(LENGTHS)
    before = _metrics(tokens_server)
    got = _predict_concurrently(tokens_server, "demo-tokens", rows)
    after = _metrics(tokens_server)

    for answer, want in zip(got, _alone("demo-tokens", rows), strict=True):
        np.testing.assert_allclose(answer, want, atol=1e-5, rtol=0)
    assert after["rows"] - before["rows"] == len(rows)
    # One queue for every length: the 8 requests leave in fewer batches than one per length.
    assert after["batches"] - before["batches"] < len(set(LENGTHS))
    assert after["real"] - before["real"] == sum(LENGTHS)
    assert after["pad"] - before["pad"] > 0


class KerasRunner(FakeRunner):
    """A demo model run by Keras in this process: the served app and its batcher, length check
    and metrics as a server has them, without Ray's start-up."""

    def __init__(self, model: str, output_shape: tuple[int | None, ...], pad_value: Any) -> None:
        from shards.partition.demo_models import build_demo

        tokens = TensorSpec("tokens", (None,), "int32", pad_value=pad_value)
        super().__init__(
            ModelSignature(model, (tokens,), (TensorSpec("logits", output_shape, "float32"),))
        )
        self.model = build_demo(model)

    async def run_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.batches.append(inputs)
        return {"logits": np.asarray(self.model(inputs["tokens"]))}


async def _predict_in_process(
    client: httpx.AsyncClient, rows: list[np.ndarray]
) -> list[np.ndarray]:
    answers = await asyncio.gather(
        *(client.post("/v1/models/fake:predict", json={"instances": [r.tolist()]}) for r in rows)
    )
    for answer in answers:
        assert answer.status_code == 200, answer.text
    return [np.asarray(a.json()["predictions"][0], dtype=np.float32) for a in answers]


async def test_a_per_token_output_is_cut_back_to_each_length() -> None:
    runner = KerasRunner("demo-tagger", (None, 8), pad_value=0)
    rows = _rows([5, 30, 11, 2], seed=1)
    async with serve(runner, max_sequence_length=MAX_LENGTH) as client:
        meta = (await client.get("/v2/models/fake")).json()
        runner.batches.clear()
        got = await _predict_in_process(client, rows)
    assert meta["parameters"]["length_padding"]["outputs_cut_back"] == ["logits"]
    assert [b["tokens"].shape for b in runner.batches] == [(4, 32)]
    for row, answer, want in zip(rows, got, _alone("demo-tagger", rows), strict=True):
        assert answer.shape == (len(row), 8)
        np.testing.assert_allclose(answer, want, atol=1e-5, rtol=0)


async def test_a_model_padding_changes_is_served_unpadded_and_exact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runner = KerasRunner("demo-conv1d", (4,), pad_value=None)
    rows = _rows([4, 19, 33, 4], seed=2)
    with caplog.at_level(logging.WARNING, "shardserve"):
        async with serve(
            runner, max_sequence_length=MAX_LENGTH, pad_inputs={"tokens": 0}, batch_timeout_ms=50.0
        ) as client:
            meta = (await client.get("/v2/models/fake")).json()
            runner.batches.clear()
            got = await _predict_in_process(client, rows)
    off = meta["parameters"]["length_padding"]["off"]
    assert off.startswith("padding changes this model's answers: output 'logits' of a row of")
    assert f"length padding off: {off}" in caplog.text
    # One queue per length, as before: the two 4-token rows share a batch, no other rows do.
    assert sorted(b["tokens"].shape for b in runner.batches) == [(1, 19), (1, 33), (2, 4)]
    for answer, want in zip(got, _alone("demo-conv1d", rows), strict=True):
        np.testing.assert_allclose(answer, want, atol=1e-5, rtol=0)


async def test_no_pad_lengths_queues_by_length_as_before() -> None:
    runner = KerasRunner("demo-tokens", (4,), pad_value=0)
    rows = _rows([7, 7, 20], seed=3)
    async with serve(
        runner, max_sequence_length=MAX_LENGTH, pad_lengths=False, batch_timeout_ms=50.0
    ) as client:
        meta = (await client.get("/v2/models/fake")).json()
        runner.batches.clear()
        got = await _predict_in_process(client, rows)
    assert meta["parameters"]["length_padding"] == {"off": "turned off by --no-pad-lengths"}
    assert sorted(b["tokens"].shape for b in runner.batches) == [(1, 20), (2, 7)]
    for answer, want in zip(got, _alone("demo-tokens", rows), strict=True):
        np.testing.assert_allclose(answer, want, atol=1e-5, rtol=0)
