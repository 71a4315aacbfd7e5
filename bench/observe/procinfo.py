"""What a server process holds, read from /proc from outside it: memory and TensorFlow."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    rss_mb: float
    peak_rss_mb: float
    tensorflow_loaded: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def read_proc(pid: int) -> ProcInfo:
    """RSS and peak RSS of ``pid``, and whether libtensorflow is mapped into it (Linux only)."""
    base = Path("/proc") / str(pid)
    try:
        status = (base / "status").read_text()
        maps = (base / "maps").read_text()
    except OSError as exc:
        raise ProcessLookupError(f"cannot read /proc/{pid}: {exc.strerror}") from None
    fields = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return ProcInfo(
        pid=pid,
        rss_mb=_kib(fields.get("VmRSS", "0 kB")) / 1024,
        peak_rss_mb=_kib(fields.get("VmHWM", "0 kB")) / 1024,
        tensorflow_loaded="libtensorflow" in maps,
    )


def _kib(value: str) -> float:
    number, _, unit = value.partition(" ")
    if unit.strip() not in ("kB", ""):
        raise ValueError(f"unexpected /proc unit {unit!r} in {value!r}; expected kB")
    return float(number)


class RssSampler:
    """``with RssSampler(pid) as s:`` -- the RSS of ``pid`` in MB every ``interval_s`` on a thread,
    in ``s.samples``: a leak climbs all along, a high-water mark of buffers levels off."""

    def __init__(self, pid: int, interval_s: float = 1.0) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            try:
                self.samples.append(round(read_proc(self.pid).rss_mb, 1))
            except ProcessLookupError:
                return
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
