"""Real faults against a real server (2 replicas on the session's Ray): a poison row, a stage that
hangs, shard actors killed with SIGKILL (one replica, then every one: requests wait for the
rebuild and /readyz stays 200). The model reads token ids through a custom layer (loaded
with --import) that hangs on a marked row, then an Embedding(10, 8) that raises on CPU for an id
out of range."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.errorcheck import assert_clean_error
from tests.serverproc import Server, running_server

HANG_ID = 8  # a row starting with this id holds its stage for an hour
POISON_ID = 1000  # out of the Embedding's range: TensorFlow raises on it on CPU

LAYERS = f'''
import time

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="fault_layers")
class HangOnMarker(keras.layers.Layer):
    """Passes ids through; a batch holding a row that starts with {HANG_ID} sleeps (a stuck device)."""

    def call(self, ids):
        def wait(x):
            if (x.numpy()[:, 0] == {HANG_ID}).any():
                time.sleep(3600)
            return x

        out = tf.py_function(wait, [ids], ids.dtype)
        out.set_shape(ids.shape)
        return out

    def compute_output_shape(self, shape):
        return shape
'''


def _build(directory: Path) -> Path:
    sys.path.insert(0, str(directory))
    import fault_layers  # type: ignore[import-not-found]
    import keras

    keras.utils.set_random_seed(5)
    ids = keras.Input((4,), dtype="int32", name="ids")
    h = fault_layers.HangOnMarker(name="hang")(ids)
    h = keras.layers.Embedding(10, 8, name="embed")(h)
    h = keras.layers.Flatten(name="flat")(h)
    out = keras.layers.Dense(3, name="scores")(h)
    path = directory / "tokens.keras"
    keras.Model(ids, out, name="tokens").save(path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("faults")
    (directory / "fault_layers.py").write_text(textwrap.dedent(LAYERS))
    return _build(directory)


@pytest.fixture(scope="module")
def server(ray_address: str, model: Path) -> Iterator[Server]:
    args = [
        "--model", str(model),
        "--import", "fault_layers",
        "--replicas", "2",
        "--ray-address", ray_address,
        "--cache-dir", str(model.parent / "cache"),
        "--max-batch-size", "8",
        "--batch-timeout-ms", "100",
        "--shard-max-restarts", "0",
        "--batch-hard-timeout-ms", "3000",
        # A rebuild on a loaded machine may take longer than the default 30 s deadline: the
        # requests held for it (and /readyz) are judged against this one.
        "--request-timeout-ms", "600000",
    ]  # fmt: skip
    with running_server(args, model.parent, env={"PYTHONPATH": str(model.parent)}) as srv:
        yield srv


def _whole(model: Path, rows: list[list[int]]) -> np.ndarray:
    import keras

    return np.asarray(keras.saving.load_model(model).predict(np.array(rows), verbose=0))


async def _post(client: httpx.AsyncClient, url: str, row: list[int]) -> httpx.Response:
    return await client.post(f"{url}/predict", json={"instances": [row]})


def _rows(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, HANG_ID, size=(n, 4)).tolist()  # never the hang marker


def _metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values)


def _shard_pids() -> list[int]:
    """The live shard actors of the session's Ray (the server's), from its GCS actor table:
    other Ray instances on the machine (a benchmark's) are not ours to kill."""
    from ray._private import state

    actors = state.actors().values()
    return sorted(
        int(a["Pid"])
        for a in actors
        if a["ActorClassName"] == "ShardActor" and a["State"] == "ALIVE"
    )


def _wait_healthy(server: Server, replicas: int, timeout: float = 240.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = httpx.get(f"{server.url}/v1/models/tokens").json()
        if status["replicas"]["healthy"] == replicas or time.monotonic() > deadline:
            return status  # type: ignore[no-any-return]
        time.sleep(0.1)


def test_a_poison_row_fails_alone_and_its_batch_mates_are_answered(
    server: Server, model: Path
) -> None:
    rows = _rows(8, seed=1)
    rows[3] = [1, 2, POISON_ID, 4]
    before = _metric(server, "shardserve_poison_isolations_total")

    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(_post(client, server.url, r) for r in rows))

    answers = asyncio.run(send())

    bad = answers[3]
    assert bad.status_code == 422, bad.text
    assert_clean_error(bad)
    assert bad.json()["error"].startswith("the model failed on this input: InvalidArgumentError:")
    assert f"= {POISON_ID} is not in [0, 10)" in bad.json()["error"]
    good = [i for i in range(8) if i != 3]
    assert [answers[i].status_code for i in good] == [200] * 7
    want = _whole(model, [rows[i] for i in good])
    got = np.array([answers[i].json()["predictions"][0] for i in good])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert _metric(server, "shardserve_poison_isolations_total") == before + 1
    # The stage's error crossed as our own exception: the front end never loaded TensorFlow.
    maps = Path(f"/proc/{server.process.pid}/maps").read_text()
    assert "libtensorflow" not in maps


def _inflight_batches(server: Server) -> float:
    return _metric(server, "shardserve_inflight_batches")


def test_a_hung_stage_is_stopped_and_other_requests_keep_flowing(
    server: Server, model: Path
) -> None:
    _wait_healthy(server, 2)
    rows = _rows(200, seed=2)

    async def scenario() -> tuple[httpx.Response, list[tuple[int, httpx.Response]]]:
        async with httpx.AsyncClient(timeout=90) as client:
            hung = asyncio.ensure_future(_post(client, server.url, [HANG_ID, 1, 2, 3]))
            deadline = time.monotonic() + 30
            while _inflight_batches(server) < 1:  # its batch is on a replica now
                assert time.monotonic() < deadline and not hung.done(), "no batch in flight"
                await asyncio.sleep(0.05)
            # One request after another, for as long as the watchdog takes (two periods: the
            # batch is retried once on the other replica, where it hangs again).
            others: list[tuple[int, httpx.Response]] = []
            for i, row in enumerate(rows):
                if hung.done():
                    break
                others.append((i, await _post(client, server.url, row)))
            return await hung, others

    hung, others = asyncio.run(scenario())

    assert hung.status_code == 504, hung.text
    assert_clean_error(hung)
    assert "watchdog" in hung.json()["error"]
    answered = [(i, r) for i, r in others if r.status_code == 200]
    # While the replica that hung is out, the other serves; while both are (the second had the
    # hung batch retried on it), requests are refused at once, told when to come back.
    refused = [r for _, r in others if r.status_code != 200]
    for r in refused:
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert "unavailable" in assert_clean_error(r)
    assert answered and answered[0][0] == 0, [r.status_code for _, r in others]
    want = _whole(model, [rows[i] for i, _ in answered])
    got = [r.json()["predictions"][0] for _, r in answered]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert _wait_healthy(server, 2)["replicas"] == {"total": 2, "healthy": 2}
    again = httpx.post(f"{server.url}/predict", json={"instances": rows[:8]}, timeout=60)
    assert again.status_code == 200, again.text


def test_a_killed_replica_is_rebuilt_and_no_request_fails(server: Server, model: Path) -> None:
    _wait_healthy(server, 2)
    rebuilds = _metric(server, "shardserve_replica_rebuilds_total")
    victim = _shard_pids()[0]
    rows = _rows(40, seed=3)

    async def stream() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=90) as client:
            answers = []
            for i, row in enumerate(rows):
                if i == 5:
                    os.kill(victim, signal.SIGKILL)  # past its restarts: shard_max_restarts 0
                answers.append(
                    await asyncio.gather(*(_post(client, server.url, row) for _ in range(2)))
                )
            return [r for pair in answers for r in pair]

    answers = asyncio.run(stream())

    assert [r.status_code for r in answers] == [200] * 80, [r.text for r in answers if r.is_error]
    want = np.repeat(_whole(model, rows), 2, axis=0)
    np.testing.assert_allclose([r.json()["predictions"][0] for r in answers], want, atol=1e-5)
    assert _wait_healthy(server, 2)["replicas"]["healthy"] == 2
    assert _metric(server, "shardserve_replica_rebuilds_total") >= rebuilds + 1
    assert victim not in _shard_pids()
    r = httpx.post(f"{server.url}/predict", json={"instances": rows[:2]})
    assert r.status_code == 200


def test_every_replica_killed_requests_wait_for_the_rebuild_and_readyz_stays_200(
    server: Server, model: Path
) -> None:
    _wait_healthy(server, 2)
    assert httpx.get(f"{server.url}/readyz").status_code == 200
    for pid in _shard_pids():
        os.kill(pid, signal.SIGKILL)

    # The server notices through its periodic stage poll (or a failing batch), then rebuilds
    # (shard_max_restarts 0). Meanwhile it stays ready: it holds requests for the rebuild.
    deadline = time.monotonic() + 60
    while httpx.get(f"{server.url}/v1/models/tokens").json()["replicas"]["healthy"] > 0:
        assert time.monotonic() < deadline, "the killed replicas never left the rotation"
        time.sleep(0.1)
    ready = httpx.get(f"{server.url}/readyz")
    rows = _rows(3, seed=4)
    held = httpx.post(f"{server.url}/predict", json={"instances": rows}, timeout=600)

    assert ready.status_code == 200, ready.text
    assert held.status_code == 200, held.text
    np.testing.assert_allclose(held.json()["predictions"], _whole(model, rows), atol=1e-5)
    assert _metric(server, "shardserve_held_rows") == 0.0
    assert "holding requests for the model's replica" in server.output()
    assert _wait_healthy(server, 2)["replicas"]["healthy"] == 2
    assert httpx.get(f"{server.url}/readyz").status_code == 200
