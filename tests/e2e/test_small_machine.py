"""4 stages on a machine with fewer cores, with the defaults: the server starts its own local
Ray, splits the cores between the stage actors and answers."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from tests.serverproc import running_server


def test_four_stages_start_on_a_private_ray_with_defaults(tmp_path: Path) -> None:
    args = ["--model", "demo-mlp", "--stages", "4", "--cache-dir", str(tmp_path / "cache")]
    with running_server(args, tmp_path) as server:
        meta = httpx.get(f"{server.url}/v1/models/demo-mlp/metadata", timeout=10).json()
        assert meta["num_stages"] == 4
        shape = meta["inputs"][0]["shape"]
        rows = np.random.default_rng(0).normal(size=(3, *shape)).round(3).tolist()
        reply = httpx.post(f"{server.url}/predict", json={"instances": rows}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["predictions"]) == 3
        log = server.output()
        # SIGTERM to the server alone, as Docker and Kubernetes send it (not to its group): the
        # private Ray it started goes with it. uvicorn's re-raised signal skips Ray's exit
        # handler, and its dashboard and runtime-env agents were left running, orphaned.
        ray_processes = psutil.Process(server.process.pid).children(recursive=True)
        assert ray_processes
        os.kill(server.process.pid, signal.SIGTERM)
        server.process.wait(timeout=60)
        deadline = time.monotonic() + 30
        while (left := [p for p in ray_processes if _running(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        for process in left:
            process.kill()
        assert not left, [p.name() for p in left]
    cores = os.cpu_count() or 1
    # Each asks for the whole TensorFlow threads of its share of the cores (at least one): the
    # private Ray's CPU count is a scheduling count sized to hold them (shards.cpu_plan).
    threads = max(1, math.floor(cores / 4))
    assert f"4 stage actor(s) ask for {threads:g} CPU each ({threads} TensorFlow thread(s))" in log


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
