"""Is the machine quiet enough to measure? Other benchmarks, the load average, and the cores
the rest of the machine uses while a server idles, all read from ``/proc``."""

from __future__ import annotations

import itertools
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.observe.cpusplit import cores, cpu_seconds

Progress = Callable[[str], None]


def busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle since boot (``/proc/stat``)."""
    with open("/proc/stat") as stat:
        jiffies = [float(x) for x in stat.readline().split()[1:9]]
    return (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def others_now(pid: int, seconds: float = 1.0) -> float:
    """Cores the rest of the machine uses now, the server idle."""
    before, tick = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return cores(before, cpu_seconds(pid), time.monotonic() - tick).get("others", 0.0)


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` alone (not its children), from ``/proc/<pid>/stat``."""
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def other_benches() -> list[str]:
    """Command lines of other ``python -m bench ...`` processes on this machine."""
    mine = {os.getpid(), os.getppid()}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a == b"-m" and b == b"bench" for a, b in itertools.pairwise(argv)):
            found.append(" ".join(x.decode(errors="replace") for x in argv if x))
    return found


def wait_until_quiet(max_load: float, timeout_s: float, progress: Progress) -> dict[str, Any]:
    """Wait (at most ``timeout_s``) until no other benchmark runs and the load is low."""
    start = time.monotonic()
    said = -1.0
    while True:
        others, load = other_benches(), os.getloadavg()[0]
        quiet = not others and load < max_load
        waited = time.monotonic() - start
        if quiet or waited >= timeout_s:
            break
        if waited - said >= 30:
            said = waited
            progress(f"waiting for quiet: 1-min load {load:.2f}, other benchmarks: {others}")
        time.sleep(5)  # the load average moves over a minute; nothing to wait on
    if not quiet and timeout_s > 0:
        progress(f"measuring anyway after {waited:.0f} s: load {load:.2f}, others {others}")
    return {
        "quiet": quiet,
        "waited_s": round(waited, 1),
        "wait_limit_s": timeout_s,
        "load_1min": load,
        "others": others,
    }
