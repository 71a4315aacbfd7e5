"""`python -m bench memory` on a tiny model: the plan-vs-measured table per stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_memory_bench_measures_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--models", "tiny", "--stages", "2", "--workdir", str(tmp_path), "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "bench", "memory", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((out / "memory.json").read_text())
    assert results["bare_tf_rss"] > 100 * 2**20
    stages = results["models"]["tiny"]["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    for stage in stages:
        assert stage["planned"] == stage["weights"] + stage["activations"] + stage["overhead"]
        assert stage["rss"] > stage["marks"]["tensorflow"] > stage["marks"]["start"]
    table = (out / "memory.md").read_text()
    assert "| tiny (batch 8) | 1 | d1..d1 |" in table
