"""`shardserve partition`: writes a bundle, refuses bad options with a clear message."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from serving.cli.main import app

runner = CliRunner()


def test_partition_writes_a_bundle(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    result = runner.invoke(app, ["partition", "demo-tiny", "--stages", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["stages"]) == 2
    assert all((out / stage["file"]).exists() for stage in manifest["stages"])
    assert "wrote 2 stage(s)" in result.output


def test_partition_refuses_both_ways_of_asking(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "partition",
            "demo-tiny",
            "--stages",
            "2",
            "--max-stage-bytes",
            "10",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 2
    assert "either --stages or --max-stage-bytes" in result.output


def test_partition_names_an_oversized_layer(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["partition", "demo-tiny", "--max-stage-bytes", "16", "--out", str(tmp_path / "b")]
    )
    assert result.exit_code == 1
    assert "error:" in result.output and "16" in result.output
