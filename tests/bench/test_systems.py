"""The systems under test: names to launch specs, and the server's flags replaced or added."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.systems import SystemConfig, launch_spec
from bench.systems.shardserve import with_flags


def test_system_names_pick_stages_and_the_compiled_graph(tmp_path: Path) -> None:
    config = SystemConfig(tmp_path / "m.keras", 9000)
    plain = launch_spec("shardserve-2", config, tmp_path)
    compiled = launch_spec("shardserve-2-cg", config, tmp_path)
    assert (plain.name, compiled.name) == ("shardserve-2", "shardserve-2-cg")
    assert "--compiled-graph" not in plain.argv
    assert compiled.argv[compiled.argv.index("--compiled-graph") + 1] == "true"
    assert compiled.argv[compiled.argv.index("--stages") + 1] == "2"
    with pytest.raises(ValueError, match=r"unknown system 'shardserve-x-cg'"):
        launch_spec("shardserve-x-cg", config, tmp_path)


def test_server_options_are_replaced_or_added() -> None:
    argv = ["shardserve", "serve", "--cpus-per-shard", "2", "--port", "1"]
    out = with_flags(argv, {"--cpus-per-shard": "1", "--replicas": "2"})
    assert out == ["shardserve", "serve", "--cpus-per-shard", "1", "--port", "1", "--replicas", "2"]
