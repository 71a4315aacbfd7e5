"""``python -m bench frontcpu``'s pure parts: the order of its windows, the ratios from canned
windows, and the server each code tree is started as; the tracing modes (their variables, their
ratios to off) and the OTLP sink. A real run starts four servers (minutes), so it is left to the
bench itself."""

from __future__ import annotations

import math
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bench.observe.otlp_sink import OtlpSink
from bench.suites.frontcpu.report import render, summarize, summarize_modes
from bench.suites.frontcpu.run import FrontCpuPlan, mode_label, schedule, server_spec, tracing_env


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


def test_tracing_modes_set_the_standard_variables_and_off_disables_the_sdk() -> None:
    assert [mode_label(m) for m in ("off", "1.0", "0.01")] == ["off", "on-1", "on-0.01"]
    assert tracing_env("off", "http://x") == {"OTEL_SDK_DISABLED": "true"}
    on = tracing_env("0.01", "http://127.0.0.1:9")
    assert on["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:9"
    assert on["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://127.0.0.1:9/v1/traces"
    assert on["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert (on["OTEL_TRACES_SAMPLER_ARG"], on["OTEL_SDK_DISABLED"]) == ("0.01", "false")
    for bad in ("on", "0", "1.5"):
        with pytest.raises(ValueError, match="'off' or a sampling ratio"):
            FrontCpuPlan(tracing=("off", bad))


def test_tracing_modes_rotate_and_are_compared_with_off(tmp_path: Path) -> None:
    modes = ("off", "on-1", "on-0.01")
    assert [label for _, _, label in schedule(2, ("grpc",), modes)] == [*modes, *modes[::-1]]
    windows = [
        {**_window(mode, r, ms), "protocol": "grpc"}
        for r, row in enumerate(((0.20, 0.30, 0.21), (0.22, 0.28, 0.22)))
        for mode, ms in zip(modes, row, strict=True)
    ]
    (cell,) = summarize_modes(windows, modes)
    assert cell["median_ms"] == pytest.approx({"off": 0.21, "on-1": 0.29, "on-0.01": 0.215})
    assert cell["ratio"] == {"off": 1.0, "on-1": 1.381, "on-0.01": 1.0238}
    tree = {"path": "/t", "commit": "abc1234", "dirty": False}
    table = render(
        {
            "plan": {"rounds": 2, "window_s": 6.0, "clients": {"light": 64}},
            "trees": {m: tree for m in modes},
            "windows": windows,
            "modes": [cell],
            "sink": {"posts": 3, "bytes": 1000},
        }
    )
    assert "| light | grpc | 64 | 0.2100 | 0.2900 | 0.2150 | 1.381 | 1.024 | 0 |" in table
    assert "3 posts" in table
    plan = FrontCpuPlan(tree=_tree(tmp_path / "t", "serving/cli/main.py"), pin=False)
    spec = server_spec(plan, tmp_path / "m.keras", plan.tree, "on-1", 8123, 0, {"A": "b"})
    assert spec.env == {"A": "b", "PYTHONPATH": str(plan.tree)}


def test_the_sink_accepts_and_counts_otlp_posts() -> None:
    with OtlpSink() as sink:
        request = urllib.request.Request(
            sink.endpoint + "/v1/traces",
            data=b"\x0a\x00",
            headers={"content-type": "application/x-protobuf"},
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200
    assert (sink.posts, sink.bytes) == (1, 2)
