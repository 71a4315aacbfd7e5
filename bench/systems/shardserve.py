"""shardserve itself: ``shardserve serve`` on the workload's ``.keras`` file with K stages."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from bench.systems.base import LaunchSpec, SystemConfig

# The CPUs a private local Ray sees; the stages share them so that K stages never ask for more.
MACHINE_CPUS = os.cpu_count() or 1


def shardserve_spec(
    config: SystemConfig,
    stages: int,
    cache_dir: Path,
    *,
    compiled: bool = False,
    flags: Mapping[str, str] | None = None,
) -> LaunchSpec:
    """``shardserve serve`` with K stages sharing the machine's CPUs (K > 1; one stage: the
    server's default); ``flags`` (``--flag``: value) replace the options of ``config`` or add
    to them."""
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    exe = shutil.which("shardserve", path=str(Path(sys.executable).parent)) or "shardserve"
    cpus = max(MACHINE_CPUS / stages, 0.25)
    argv = [
        exe,
        "serve",
        "--model",
        str(config.model_path),
        "--stages",
        str(stages),
        "--port",
        str(config.port),
        "--max-batch-size",
        str(config.max_batch_size),
        "--batch-timeout-ms",
        str(config.batch_timeout_ms),
        # One stage: the server's own choice (one actor with its share of the cores as
        # threads: ``--stage-cores``), so that the bench measures the defaults;
        # SHARDSERVE_STAGE_CORES=replicas in the bench's environment measures one
        # single-threaded replica per core where copies fit.
        *(["--cpus-per-shard", f"{cpus:g}"] if stages > 1 else []),
        "--cache-dir",
        str(cache_dir),
        "--log-level",
        "warning",
    ]
    if config.simulate_device_ms is not None:
        argv += ["--simulate-device-ms", f"{config.simulate_device_ms:g}"]
    if compiled:
        argv += ["--compiled-graph", "true"]
    name = f"shardserve-{stages}{'-cg' if compiled else ''}"
    return LaunchSpec(name, with_flags(argv, flags or {}))


def with_flags(argv: list[str], flags: Mapping[str, str]) -> list[str]:
    """``argv`` with each ``--flag value`` of ``flags`` replaced, or appended when absent."""
    out = list(argv)
    for flag, value in flags.items():
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out
