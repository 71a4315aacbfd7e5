"""The machine a bench ran on, in one line: cores, CPU model, OS, Python and the versions of the
libraries that decide the numbers."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = []
    for pkg in ("ray", "tensorflow", "keras", "litserve", "fastapi", "uvicorn"):
        try:
            versions.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            continue
    return (
        f"{os.cpu_count()} CPU cores ({cpu}), {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}; " + ", ".join(versions)
    )
