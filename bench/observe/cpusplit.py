"""Where the CPU went during a phase, in cores: the server's front end, its model workers (shard
actors; Ray Serve's replicas; LitServe's worker processes), the rest of its Ray, and the load
generator (a child this process waited for); and the same per request, per row and as the
machine's idle share (``per_work``)."""

from __future__ import annotations

import os
import resource
from pathlib import Path

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
        out[_part(cmdline)] += used
    out["load_generator"] = children_cpu()
    out["machine"] = machine_busy_seconds()
    return out


def cores(before: CpuSeconds, after: CpuSeconds, seconds: float) -> dict[str, float]:
    """Mean cores busy per part between two samples ``seconds`` apart; ``others`` is what the
    rest of the machine (this bench's driver included) used."""
    if seconds <= 0:
        return {}
    used = {k: (after[k] - before.get(k, 0.0)) / seconds for k in after}
    machine = used.pop("machine", 0.0)
    used["others"] = max(machine - sum(used.values()), 0.0)
    return {k: round(v, 3) for k, v in used.items()}


def per_work(
    parts: dict[str, float], seconds: float, served: float, rows: float | None, machine_cores: int
) -> dict[str, float | None]:
    """``cores``' figures as CPU per unit of work over a window of ``seconds``: the front end's
    and the rest of Ray's ms per request answered (``served``), the model workers' ms per row
    computed (``rows``: the batches' rows, from ``/metrics``; None where the server has no such
    count: then per request), and the share of the machine's ``machine_cores`` left idle."""

    def ms(part: str, per: float | None) -> float | None:
        return 1000 * parts.get(part, 0.0) * seconds / per if per else None

    busy = sum(parts.values())
    return {
        "frontend_ms_per_request": ms("frontend", served),
        "workers_ms_per_row": ms("shard_actors", rows if rows else served),
        "ray_ms_per_request": ms("ray_other", served),
        "idle_share": max(0.0, 1 - busy / machine_cores) if machine_cores else None,
    }


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` alone (not its children), from ``/proc/<pid>/stat``."""
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    """CPU seconds of this process's children that it waited for (the load generators)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle since boot (Linux /proc/stat)."""
    try:
        fields = open("/proc/stat").readline().split()[1:]  # noqa: SIM115 - one line
    except OSError:
        return 0.0
    jiffies = [float(x) for x in fields]
    idle = jiffies[3] + (jiffies[4] if len(jiffies) > 4 else 0.0)  # idle + iowait
    # guest time is already counted in user and nice
    total = sum(jiffies[:8])
    return (total - idle) / os.sysconf("SC_CLK_TCK")


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def _part(cmdline: list[str]) -> str:
    """The part a child of the server counts in: the model's workers (a shard actor, a
    generation stage, a Ray Serve replica, or a process of no Ray: LitServe's workers), else the rest of Ray."""
    first = cmdline[0] if cmdline else ""
    if first.startswith(("ray::ShardActor", "ray::GenerationStage", "ray::ServeReplica")):
        return "shard_actors"
    if "ray" in " ".join(cmdline[:3]).lower():
        return "ray_other"
    return "shard_actors"
