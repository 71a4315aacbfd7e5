"""4 stages on a machine with fewer cores, with the defaults: the server starts its own local
Ray, splits the cores between the stage actors and answers."""

from __future__ import annotations

import math
import os
from pathlib import Path

import httpx
import numpy as np

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
    cores = os.cpu_count() or 1
    share = math.floor(cores / 4 * 10_000) / 10_000
    threads = max(1, math.floor(share))
    assert f"4 stage actor(s) ask for {share:g} CPU each ({threads} TensorFlow thread(s))" in log
