"""Where the CPU went during a phase, in cores: the server's front end, its shard actors, the
rest of its Ray, and the load generator (a child this process waited for)."""

from __future__ import annotations

import resource

import psutil

CpuSeconds = dict[str, float]


def cpu_seconds(server_pid: int) -> CpuSeconds:
    """CPU seconds used so far by each part. A part that died since the last sample (a killed
    actor) takes its seconds with it: compare samples of a phase without deaths."""
    out = {"frontend": 0.0, "shard_actors": 0.0, "ray_other": 0.0}
    try:
        server = psutil.Process(server_pid)
        out["frontend"] = _cpu(server)
        children = server.children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for child in children:
        try:
            cmdline = child.cmdline()
            used = _cpu(child)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        part = (
            "shard_actors" if cmdline and cmdline[0].startswith("ray::ShardActor") else "ray_other"
        )
        out[part] += used
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    out["load_generator"] = usage.ru_utime + usage.ru_stime
    return out


def cores(before: CpuSeconds, after: CpuSeconds, seconds: float) -> dict[str, float]:
    """Mean cores busy per part between two samples ``seconds`` apart."""
    if seconds <= 0:
        return {}
    return {k: round((after[k] - before.get(k, 0.0)) / seconds, 3) for k in after}


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)
