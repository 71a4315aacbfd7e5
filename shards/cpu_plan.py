"""How many CPUs each stage actor asks for, and how many logical CPUs a private local Ray gets.

On a private local Ray, Ray's ``CPU`` is a scheduling count, not the machine: starting Ray with
more CPUs than cores is legal. What the cores really do is set by the TensorFlow thread pools,
which each stage actor sizes to the whole CPUs it was granted (``intra_op_threads``). So a stage
asks for the threads its share of the real cores gives it, and the private Ray's count covers
every model the server will run (``scheduling_cpus``), plus room for one more: a second model
no longer waits for CPUs the first took. Pure: no Ray, so the front end can size Ray before
starting it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

__all__ = ["Pipeline", "cpus_per_stage", "intra_op_threads", "machine_cores", "scheduling_cpus"]

# (stages, replicas, cpus_per_shard or None): one model version's pipelines as the server will
# start them; stages may be an estimate (a model not cut yet).
Pipeline = tuple[int, int, float | None]


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's cpuset included)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def intra_op_threads(cpus: float) -> int:
    """TensorFlow threads for an actor granted ``cpus``: whole cores, at least one, so the
    stages sharing a machine never run more threads than it has cores (when each has >= 1)."""
    return max(1, math.floor(cpus + 1e-9))


def cpus_per_stage(
    requested: float | None, *, private_ray: bool, actors: int, cores: int | None = None
) -> float:
    """The CPUs each stage actor asks for. A value the user gave is kept. Unset on a private
    local Ray: the whole threads of its share of this machine's ``cores`` among the model's
    ``actors`` (at least 1: 4 stages on 2 cores ask 1 each, one TensorFlow thread each); the
    private Ray's count is sized to hold them (``scheduling_cpus``). Unset on a joined
    cluster, whose CPUs are real: 1 each."""
    if requested is not None:
        return requested
    if not private_ray or actors < 1:
        return 1.0
    return float(intra_op_threads((cores or machine_cores()) / actors))


def pipeline_cpus(pipeline: Pipeline, cores: int) -> float:
    """What one model version's stage actors ask for together on a private Ray."""
    stages, replicas, requested = pipeline
    actors = max(1, stages) * max(1, replicas)
    return actors * cpus_per_stage(requested, private_ray=True, actors=actors, cores=cores)


def scheduling_cpus(pipelines: Iterable[Pipeline], cores: int | None = None) -> int:
    """The logical CPUs to start a private local Ray with: every model version's stage actors
    (``pipeline_cpus``), plus headroom for one more version as large as the largest of them or
    the whole machine, whichever is more (a version added by polling, a replica rebuilt while
    its old actors still exit)."""
    cores = cores or machine_cores()
    asks = [pipeline_cpus(p, cores) for p in pipelines]
    headroom = max([float(cores), *asks])
    return math.ceil(sum(asks) + headroom)
