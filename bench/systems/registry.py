"""System names on the command line -> launch specs."""

from __future__ import annotations

from pathlib import Path

from bench.systems.base import LaunchSpec, SystemConfig
from bench.systems.peers import litserve_spec, rayserve_spec
from bench.systems.shardserve import shardserve_spec

SYSTEMS = ("shardserve-1", "shardserve-2", "litserve", "rayserve")


def launch_spec(name: str, config: SystemConfig, cache_dir: Path) -> LaunchSpec:
    if name.startswith("shardserve-"):
        suffix = name.removeprefix("shardserve-")
        # shardserve-K-cg: the same with --compiled-graph (bench adds -auto after either)
        compiled = suffix.endswith("-cg")
        suffix = suffix.removesuffix("-cg")
        if suffix.isdigit():
            return shardserve_spec(config, int(suffix), cache_dir, compiled=compiled)
    elif name == "litserve":
        return litserve_spec(config)
    elif name == "rayserve":
        return rayserve_spec(config)
    raise ValueError(f"unknown system {name!r}; expected one of {SYSTEMS} (or shardserve-K[-cg])")
