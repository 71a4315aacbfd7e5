"""bench.gpu_stage off a GPU: it says why and exits 2; its recomputed plan is shards' plan."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_stage
from shards.partition.graph import analyse
from shards.partition.memory_plan import MemoryModel

ROOT = Path(__file__).resolve().parents[2]


def test_without_jax_or_a_gpu_it_says_so_and_exits_2() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_stage", "--batches", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == gpu_stage.NO_DEVICE, done.stderr
    assert done.stdout == ""
    assert "this bench runs on a GPU only" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("units", [None, 16])
def test_the_recomputed_plan_is_the_memory_plan(units: int | None) -> None:
    model = gpu_stage.build_stage(width=32, layers=3, units=units)
    graph = analyse(model)
    need = MemoryModel(graph, 8, 0).need(0, len(graph.nodes))

    got = gpu_stage.recomputed_plan(model, rows=8)

    assert got == {"weight_bytes": need.weight_bytes, "activation_bytes": need.activation_bytes}
