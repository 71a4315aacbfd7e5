"""``python -m bench frontcpu``'s pure parts: the order of its windows, the ratios from canned
windows, and the server each code tree is started as. A real run starts four servers (minutes),
so it is left to the bench itself."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench.suites.frontcpu import FrontCpuPlan, schedule, server_spec
from bench.suites.frontcpu_report import render, summarize


def _window(tree: str, round_: int, cpu_ms: float, errors: int = 0) -> dict[str, Any]:
    return {
        "workload": "light",
        "protocol": "tfserving",
        "round": round_,
        "tree": tree,
        "cpu_ms_per_request": cpu_ms,
        "served": 1000,
        "rps": 500.0,
        "p99_ms": 12.0,
        "errors": errors,
        "mean_batch_rows": 30.0,
        "frontend_cores": 0.4,
        "loadgen_cores": 0.1,
        "cores": {"others": 0.05},
        "loadavg": [0.5, 0.6],
    }


def _tree(root: Path, cli: str) -> Path:
    (root / cli).parent.mkdir(parents=True)
    (root / cli).write_text("")
    return root


def test_windows_alternate_trees_and_flip_the_order_each_round() -> None:
    order = schedule(3, ("tfserving", "v2-binary"))
    assert order == [
        (0, "tfserving", "old"),
        (0, "tfserving", "new"),
        (0, "v2-binary", "old"),
        (0, "v2-binary", "new"),
        (1, "tfserving", "new"),
        (1, "tfserving", "old"),
        (1, "v2-binary", "new"),
        (1, "v2-binary", "old"),
        (2, "tfserving", "old"),
        (2, "tfserving", "new"),
        (2, "v2-binary", "old"),
        (2, "v2-binary", "new"),
    ]


def test_ratio_per_round_pairs_the_round_and_the_verdict_uses_the_medians() -> None:
    windows = [
        _window("old", 0, 0.20),
        _window("new", 0, 0.22),
        _window("new", 1, 0.19),
        _window("old", 1, 0.20),
        _window("old", 2, 0.40),
        _window("new", 2, 0.20),
    ]
    (cell,) = summarize(windows)
    assert [r["ratio"] for r in cell["rounds"]] == [1.1, 0.95, 0.5]
    assert (cell["old_median_ms"], cell["new_median_ms"]) == (0.20, 0.20)
    assert cell["ratio"] == 1.0 and cell["within_limit"]
    results = {
        "plan": {"rounds": 3, "window_s": 6.0, "clients": {"light": 64}},
        "trees": {
            "old": {"path": "/old", "commit": "9277f20", "dirty": False},
            "new": {"path": "/new", "commit": "e5f5eb1", "dirty": True},
        },
        "windows": windows,
        "summary": [cell],
    }
    table = render(results)
    assert (
        "| light | tfserving | 64 | 0.2000 | 0.2000 | 1.000 | 1.100, 0.950, 0.500 | yes |" in table
    )
    assert "new = e5f5eb1 + local edits (/new)" in table
    assert table.count("| light | tfserving | ") == 1 + len(windows)


def test_over_five_percent_errors_or_no_answers_never_pass() -> None:
    (over,) = summarize([_window("old", 0, 0.20), _window("new", 0, 0.2102)])
    assert over["ratio"] == 1.051 and not over["within_limit"]
    (failed,) = summarize([_window("old", 0, 0.20), _window("new", 0, 0.10, errors=3)])
    assert failed["errors"] == 3 and not failed["within_limit"]
    (silent,) = summarize([_window("old", 0, math.nan), _window("new", 0, 0.2)])
    assert silent["ratio"] is None and silent["old_median_ms"] is None
    assert not silent["within_limit"]


def test_each_tree_runs_its_own_cli_from_its_own_folder(tmp_path: Path) -> None:
    old = _tree(tmp_path / "old", "serving/cli.py")
    new = _tree(tmp_path / "new", "serving/cli/main.py")
    plan = FrontCpuPlan(tree=new, compare_tree=old, pin=False, workdir=tmp_path / "work")
    model = tmp_path / "light.keras"
    for tree, module in ((old, "serving.cli"), (new, "serving.cli.main")):
        spec = server_spec(plan, model, tree, "x", 8123)
        assert spec.argv[1:4] == ["-m", module, "serve"]
        assert spec.cwd == tree and spec.env["PYTHONPATH"] == str(tree)
        flags = dict(zip(spec.argv[4::2], spec.argv[5::2], strict=False))
        assert flags["--model"] == str(model) and flags["--stages"] == "1"
        assert flags["--max-batch-size"] == "64" and flags["--batch-timeout-ms"] == "5.0"
        assert flags["--grpc-port"] == "0" and flags["--port"] == "8123"
        assert Path(flags["--cache-dir"]).is_absolute()


def test_a_folder_that_is_no_code_tree_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a shardserve code tree"):
        FrontCpuPlan(compare_tree=tmp_path)
    with pytest.raises(ValueError, match="protocols must be among"):
        FrontCpuPlan(protocols=("websocket",))
