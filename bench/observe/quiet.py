"""Is the machine quiet enough to measure? Other benchmarks, the load average, and the cores
the rest of the machine uses while a server idles, all read from ``/proc``."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

from bench.observe.cpusplit import cores, cpu_seconds
from bench.options import Progress


def others_now(pid: int, seconds: float = 1.0) -> float:
    """Cores the rest of the machine uses now, the server idle."""
    before, tick = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return cores(before, cpu_seconds(pid), time.monotonic() - tick).get("others", 0.0)


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
