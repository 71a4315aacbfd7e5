"""How many CPUs each stage actor asks for, and how many logical CPUs a private local Ray gets.

On a private local Ray, Ray's ``CPU`` is a scheduling count, not the machine: starting Ray with
more CPUs than cores is legal. What the cores really do is set by the TensorFlow thread pools,
which each stage actor sizes to the whole CPUs it was granted (``intra_op_threads``). So a stage
asks for the threads its share of the real cores gives it, and the private Ray's count covers
every model the server will run (``scheduling_cpus``), plus room for one more: a second model
no longer waits for CPUs the first took. Pure: no Ray, so the front end can size Ray before
starting it.

A model of one small stage may take the cores another way (``stage_copies``, where the operator
asks for it: ``stage_cores = "replicas"``): N single-threaded replicas instead of one actor with
N TensorFlow threads. On one 2-core machine two single-threaded replicas of a 1-stage MLP served
8-15% more requests per second than one two-threaded actor; on another they gave no gain on the
same model and 25% more c=1 latency (a batch of one row on one thread), +4% on a light model
(docs/tuning.md). It costs a copy of the weights per replica, so it is done only where every
copy fits.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

__all__ = [
    "COPIES_MEMORY_SHARE",
    "Pipeline",
    "available_memory",
    "cpus_per_stage",
    "intra_op_threads",
    "machine_cores",
    "scheduling_cpus",
    "stage_copies",
]

# The share of the machine's available memory the copies of a stage may take together: the rest
# is the front end's, Ray's and the page cache's.
COPIES_MEMORY_SHARE = 0.5

# (stages, replicas, cpus_per_shard or None): one model version's pipelines as the server will
# start them; stages may be an estimate (a model not cut yet).
Pipeline = tuple[int, int, float | None]


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's cpuset included)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def available_memory() -> int:
    """Bytes this machine can give a new process without swapping (``MemAvailable``); the free
    pages where ``/proc/meminfo`` is not there."""
    try:
        for line in open("/proc/meminfo").read().splitlines():  # noqa: SIM115 - one read
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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


def stage_copies(stages: int, stage_bytes: int, cores: int, available_bytes: int) -> int:
    """How many single-threaded replicas serve a model instead of one actor with ``cores``
    TensorFlow threads: ``cores`` for a model of one stage whose ``cores`` copies (each its
    memory plan's peak, ``stage_bytes``) fit in ``COPIES_MEMORY_SHARE`` of ``available_bytes``;
    else 1 (one actor, the cores as its threads). The caller asks only where the choice is the
    server's: a private Ray, and no budget, replica count or CPUs per shard given."""
    if stages != 1 or cores < 2 or stage_bytes <= 0:
        return 1
    if cores * stage_bytes > COPIES_MEMORY_SHARE * available_bytes:
        return 1
    return cores
