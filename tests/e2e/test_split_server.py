"""A layer larger than one device, through the real server (issue 29): the recommender saved as a
user would and served under a budget smaller than its item table, which is split into two part
actors. Answers equal the whole model's, /metrics shows the parts as stages "0.0" and "0.1", and
an id outside the vocabulary is its own request's 422 while its batch-mates are answered."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.e2e.test_faults import assert_clean_error
from tests.serverproc import Server, running_server
from tests.shards.partition.test_layer_split import recommender_inputs


@pytest.fixture(scope="module")
def recommender(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """The model as a ``.keras`` file, and 6 rows with the whole model's answers."""
    from shards.partition.demo_models import demo_recommender

    model = demo_recommender()
    path = tmp_path_factory.mktemp("rec") / "rec.keras"
    model.save(path)
    rows = recommender_inputs(6)
    rows["scores"] = np.asarray(model([rows[t.name] for t in model.inputs]))
    return path, rows


@pytest.fixture(scope="module")
def split_server(
    tmp_path_factory: pytest.TempPathFactory,
    ray_address: str,
    recommender: tuple[Path, dict[str, np.ndarray]],
) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("split-server")
    args = [
        "--model", str(recommender[0]),
        # The item table alone is 768 000 bytes: over the budget, it is split in two.
        "--max-stage-bytes", "600KB",
        "--device-overhead-bytes", "0",
        "--max-batch-size", "8",
        "--ray-address", ray_address,
        "--cache-dir", str(workdir / "cache"),
    ]  # fmt: skip
    with running_server(args, workdir) as server:
        yield server


def _instance(rows: dict[str, np.ndarray], i: int) -> dict[str, list[int]]:
    return {k: rows[k][i].tolist() for k in ("history", "item", "user")}


def test_the_split_recommender_answers_as_the_whole_model(
    split_server: Server, recommender: tuple[Path, dict[str, np.ndarray]]
) -> None:
    rows = recommender[1]
    url = f"{split_server.url}/v1/models/rec:predict"
    answer = httpx.post(url, json={"instances": [_instance(rows, i) for i in range(6)]}, timeout=60)
    assert answer.status_code == 200, answer.text
    # A lookup split by rows is exact, and so is every layer after it.
    got = np.asarray(answer.json()["predictions"], dtype=np.float32)
    np.testing.assert_array_equal(got, rows["scores"])

    metrics = httpx.get(f"{split_server.url}/metrics", timeout=10).text
    calls = [ln for ln in metrics.splitlines() if ln.startswith("shardserve_stage_calls_total")]
    assert {
        s for s in ('stage="0.0"', 'stage="0.1"', 'stage="1"') if any(s in c for c in calls)
    } == {
        'stage="0.0"',
        'stage="0.1"',
        'stage="1"',
    }, calls


def test_an_id_outside_the_vocabulary_fails_alone(
    split_server: Server, recommender: tuple[Path, dict[str, np.ndarray]]
) -> None:
    rows = recommender[1]
    instances = [_instance(rows, i) for i in range(6)]
    instances[2]["item"] = [7000]
    url = f"{split_server.url}/v1/models/rec:predict"

    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(client.post(url, json={"instances": [row]}) for row in instances)
            )

    answers = asyncio.run(send())
    bad = answers[2]
    assert bad.status_code == 422, bad.text
    assert_clean_error(bad)
    assert "indices[0,0] = 7000 is not in [0, 6000)" in bad.json()["error"]
    good = [i for i in range(6) if i != 2]
    assert [answers[i].status_code for i in good] == [200] * 5
    got = np.array([answers[i].json()["predictions"][0] for i in good], dtype=np.float32)
    # Batched otherwise than the whole model's six rows: a matrix kernel may differ in the last
    # bit with the batch's size.
    np.testing.assert_allclose(got, rows["scores"][good], rtol=1e-6, atol=1e-7)
