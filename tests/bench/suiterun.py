"""One suite of ``python -m bench`` run on a tiny setting, its results and its table read back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

from bench.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
# The comparison (`run`) writes the report of docs/, not a suite's own table.
_WRITES = {"run": ("bench_results", "benchmarks")}


class SuiteRun:
    """``run(suite, *args)``: ``python -m bench suite args`` under a temporary workdir and
    ``--out``; returns the results it wrote. ``child=True`` runs it in a process of its own (a
    suite that starts its own local Ray cannot share this process with the session's)."""

    def __init__(self, tmp_path: Path) -> None:
        self.out = tmp_path / "out"
        self.workdir = tmp_path / "work"

    def run(
        self, suite: str, *args: str, child: bool = False, timeout_s: float = 900.0
    ) -> dict[str, Any]:
        argv = [suite, *args, "--workdir", str(self.workdir), "--out", str(self.out)]
        if child:
            done = subprocess.run(
                [sys.executable, "-m", "bench", *argv],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            assert done.returncode == 0, done.stderr[-2000:]
        else:
            assert main(argv) == 0
        results, _ = _WRITES.get(suite, (suite, suite))
        return dict(orjson.loads((self.out / f"{results}.json").read_bytes()))

    def table(self, suite: str) -> str:
        _, table = _WRITES.get(suite, (suite, suite))
        return (self.out / f"{table}.md").read_text()
