"""The real server (uvicorn in a subprocess) with a 2-stage model on the session's local Ray."""

from __future__ import annotations

import select
import signal
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.metrics_text import has_series, metric
from tests.serverproc import Server, running_server


def _residual_model(path: Path) -> None:
    import keras

    keras.utils.set_random_seed(11)
    inp = keras.Input((12,), name="features")
    h = keras.layers.Dense(32, activation="relu", name="d1")(inp)
    r = keras.layers.Dense(32, activation="relu", name="d2")(h)
    h = keras.layers.Add(name="skip")([h, r])
    h = keras.layers.Dense(16, activation="tanh", name="d3")(h)
    out = keras.layers.Dense(3, name="scores")(h)
    keras.Model(inp, out, name="resid").save(path)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("e2e") / "resid.keras"
    _residual_model(path)
    return path


@pytest.fixture(scope="module")
def server(ray_address: str, model_path: Path) -> Iterator[Server]:
    args = [
        "--model", str(model_path),
        "--stages", "2",
        "--ray-address", ray_address,
        "--cache-dir", str(model_path.parent / "cache"),
        "--max-batch-size", "8",
        "--batch-timeout-ms", "20",
        "--body-read-timeout-s", "2",  # no other test's body takes a fraction of that
    ]  # fmt: skip
    with running_server(args, model_path.parent) as srv:
        yield srv


def _expected(model_path: Path, rows: np.ndarray) -> np.ndarray:
    import keras

    return np.asarray(keras.saving.load_model(model_path).predict(rows, verbose=0))


def test_predictions_match_the_whole_model(server: Server, model_path: Path) -> None:
    rows = np.random.default_rng(0).normal(size=(5, 12)).astype("float32")
    r = httpx.post(f"{server.url}/predict", json={"instances": rows.tolist()}, timeout=60)
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["predictions"], dtype="float32")
    np.testing.assert_allclose(got, _expected(model_path, rows), atol=1e-5)


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(
    server: Server, model_path: Path
) -> None:
    rows = np.random.default_rng(1).normal(size=(24, 12)).astype("float32")

    def one(i: int) -> np.ndarray:
        r = httpx.post(f"{server.url}/predict", json={"instances": [rows[i].tolist()]}, timeout=60)
        assert r.status_code == 200, r.text
        return np.asarray(r.json()["predictions"][0], dtype="float32")

    def batches_and_rows() -> tuple[float, float]:
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        count = _metric(metrics, "shardserve_batch_size_rows_count")
        return count, _metric(metrics, "shardserve_batch_size_rows_sum")

    batches_before, rows_before = batches_and_rows()
    with ThreadPoolExecutor(8) as pool:
        got = np.stack(list(pool.map(one, range(len(rows)))))
    batches_after, rows_after = batches_and_rows()

    np.testing.assert_allclose(got, _expected(model_path, rows), atol=1e-5)
    # This test's own 24 rows went out in fewer batches than rows: some batches held several.
    assert rows_after - rows_before == 24
    assert batches_after - batches_before < 24


def test_metadata_and_bad_input(server: Server) -> None:
    meta = httpx.get(f"{server.url}/v1/models/resid/metadata", timeout=10).json()
    assert meta["num_stages"] == 2
    assert meta["inputs"] == [{"name": "features", "shape": [12], "dtype": "float32"}]
    assert meta["outputs"][0]["shape"] == [3]
    r = httpx.post(f"{server.url}/predict", json={"instances": [[1.0, 2.0]]}, timeout=10)
    assert r.status_code == 400
    assert r.json() == {"error": "input 'features' has shape (1, 2); expected (n, 12) float32"}


def test_a_trickled_body_gets_408_and_the_connection_closed(server: Server) -> None:
    """A client sending its body a byte at a time, steadily (never 2 s apart), is cut at
    --body-read-timeout-s all the same, and reads the whole 408 before the connection ends."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /predict HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"content-length: 100000\r\n\r\n" + b"1" * 10
        )
        sent = 10
        while not select.select([sock], [], [], 0.05)[0]:
            sock.sendall(b"1")
            sent += 1
            assert sent < 400, "no answer after 20 s of bytes, 50 ms apart"
        answer = b""
        while chunk := sock.recv(65536):  # until the server closes it
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 408 Request Timeout"
    assert b"connection: close" in head.lower()
    assert body.startswith(b'{"error":"the request body did not arrive within '
                           b'body_read_timeout_s=2 s (')  # fmt: skip


def test_sigterm_shuts_down_cleanly(server: Server) -> None:
    # The module's server, stopped: this test comes after every other test that uses it.
    # uvicorn drains, then re-raises the signal so that the exit status says SIGTERM
    assert server.terminate() in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in server.output()


def test_load_failure_exits_non_zero_with_the_reason(ray_address: str, tmp_path: Path) -> None:
    args = ["--model", str(tmp_path / "missing.keras"), "--ray-address", ray_address]
    with running_server(args, tmp_path, ready=False) as srv:
        code = srv.process.wait(timeout=300)
        assert code == 1
        assert "the model failed to load" in srv.output()


def _metric(text: str, name: str) -> float:
    assert has_series(text, name), f"{name} not in /metrics"
    return metric(text, name)
