"""What a stage actor really holds, measured in its own process: resident memory (Linux
``/proc/self/status``) at the marks of its start-up, and on a GPU TensorFlow's allocator.

The marks make "above a bare TensorFlow process" measurable inside the actor: ``start`` is the
Ray worker before TensorFlow, ``tensorflow`` after importing and configuring it, ``weights``
after the stage loaded (before any batch ran), ``loaded`` after it warmed up at every batch size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")


def _status(*keys: str) -> tuple[int, ...]:
    """The bytes of each ``/proc/self/status`` field in ``keys``; 0s where /proc is not there."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return tuple(0 for _ in keys)
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return tuple(int(fields.get(key, "0 kB").split()[0]) * 1024 for key in keys)


def rss() -> tuple[int, int]:
    """(current, peak) resident bytes of this process; (0, 0) where /proc is not there."""
    current, peak = _status("VmRSS", "VmHWM")
    return current, peak


def rss_shared_memory() -> int:
    """The resident bytes of shared memory this process maps (``RssShmem``): on a Ray worker
    mostly the object store's pages it wrote or read (``/dev/shm``), counted in the RSS too but
    not held by this process alone."""
    return _status("RssShmem")[0]


def gpu_memory(device: str) -> dict[str, int] | None:
    """TensorFlow's current and peak bytes on the actor's GPU; None on a CPU."""
    if not device.startswith("/GPU"):
        return None
    import tensorflow as tf

    info = tf.config.experimental.get_memory_info("GPU:0")
    return {"current": int(info["current"]), "peak": int(info["peak"])}


class MemoryMarks:
    def __init__(self) -> None:
        self.marks: dict[str, int] = {}
        self.mark("start")

    def mark(self, name: str) -> None:
        self.marks[name] = rss()[0]

    def report(self, device: str, planned_peak_bytes: int, weight_bytes: int) -> dict[str, Any]:
        current, peak = rss()
        base = self.marks.get("tensorflow", 0)
        return {
            "rss_bytes": current,
            "rss_peak_bytes": peak,
            "rss_marks": dict(self.marks),
            "rss_shared_memory_bytes": rss_shared_memory(),
            # What loading and running the stage added to a process that had TensorFlow.
            "rss_above_tensorflow_bytes": max(0, current - base) if base else None,
            "planned_peak_bytes": planned_peak_bytes,
            "weight_bytes": weight_bytes,
            "gpu": gpu_memory(device),
        }
