"""A small real sweep: ``shardserve tune`` against a real demo-tiny server on the session's Ray."""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

TOKEN = "tune-test-token"
READY_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", TF_CPP_MIN_LOG_LEVEL="2")
    return env


def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(f"{url}/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            # Waiting on the process is the pause between probes, and ends at once if it dies.
            try:
                process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                continue
            break
    pytest.fail(f"server at {url} not ready (exit {process.poll()}):\n{log.read_text()[-3000:]}")


@pytest.fixture
def server(ray_address: str, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = tmp_path / "server.log"
    command = [
        sys.executable, "-m", "serving.cli", "serve", "--model", "demo-tiny",
        "--admin-token", TOKEN, "--port", str(port), "--ray-address", ray_address,
        "--cache-dir", str(tmp_path / "cache"), "--batch-timeout-ms", "2",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, log)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_small_sweep_writes_every_file(server: str, tmp_path: Path) -> None:
    out = tmp_path / "tune"
    command = [
        sys.executable, "-m", "serving.cli", "tune", "--url", server, "--timeouts", "0,auto",
        "--loads", "4", "--duration", "3", "--warmup", "1", "--slo-p99-ms", "1000",
        "--out", str(out), "--admin-token", TOKEN,
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=180, env=child_env(), check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]

    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["load"], r["timeout"]) for r in rows] == [("c=4", "0"), ("c=4", "auto")]
    assert all(int(r["requests"]) > 0 and float(r["rps"]) > 0 for r in rows)

    report = (out / "report.md").read_text()
    assert "## Load c=4" in report
    assert "**winner**" in report
    assert "## auto against the best fixed timeout" in report

    assert (out / "latency_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    recommended = tomllib.loads((out / "recommended.toml").read_text())["shardserve"]
    assert recommended["batch_timeout_ms"] in (0, "auto")
    assert recommended["slo_p99_ms"] == 1000

    # The sweep puts the server's own policy back.
    view = httpx.get(
        f"{server}/admin/batching", headers={"Authorization": f"Bearer {TOKEN}"}
    ).json()
    assert view["batch_timeout_ms"] == 2.0
