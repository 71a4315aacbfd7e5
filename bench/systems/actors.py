"""Shard actors without a server, on a private local Ray: the memory and datapath benches start
and measure them directly. Their models are partitioned in a child process, so that this process
never loads TensorFlow."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

# The actors and the children run on the CPU, quietly (these benches measure CPU memory and time).
CPU_ONLY = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}


def cpu_only_env() -> dict[str, str]:
    return {**os.environ, **CPU_ONLY}


def partition_in_child(
    module: str,
    args: tuple[object, ...],
    out: Path,
    stages: int,
    plan_batch_rows: int | None = None,
) -> None:
    """The bundle of ``module.build(*args)`` in ``stages`` stages at ``out``, named after
    ``args[0]``."""
    options = f"stages={stages}, source_name={args[0]!r}"
    if plan_batch_rows is not None:
        options += f", plan_batch_rows={plan_batch_rows}"
    code = (
        f"from {module} import build; from shards.partition.cut import partition_to_bundle; "
        f"partition_to_bundle(build(*{args!r}), {str(out)!r}, {options})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=cpu_only_env())


@contextlib.contextmanager
def local_ray(num_cpus: int) -> Iterator[None]:
    """A private local Ray of ``num_cpus`` logical CPUs for the time of the block."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        runtime_env={"env_vars": CPU_ONLY},
    )
    try:
        yield
    finally:
        ray.shutdown()
