"""TensorFlow's C++ logging: quiet unless the user asks for it (``--log-level debug``).

``TF_CPP_MIN_LOG_LEVEL`` is read when TensorFlow is loaded, so it is set before the first
``import tensorflow`` of a process: by the CLI for ``partition`` and ``plan``, and through the
job's ``runtime_env`` for the Ray workers (resolve task, shard actors). At 3 even the
``Failed call to cuInit`` error of every CPU-only machine stays out of the way; a user's own
value of the variable is kept.

TensorFlow writes a few lines while its libraries load, before it has read the variable
(``oneDNN custom operations are on``, ``Could not find cuda drivers``): ``import_tensorflow``
holds back the stderr of the import and lets through all but the lines below that level.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from types import ModuleType

from shards.actor.heap_trim import use_system_allocator

ENV = "TF_CPP_MIN_LOG_LEVEL"
QUIET = "3"  # errors too: on a CPU machine TensorFlow reports the missing GPU as one
# "I0000 00:00:1795440280.951162    5727 cuda_platform.cc:52] message" (absl's format).
_RECORD = re.compile(rb"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [^\s:]+:\d+\] ")
_PREFACE = b"WARNING: All log messages before absl::InitializeLog() is called"
_SEVERITY = {b"I": 0, b"W": 1, b"E": 2, b"F": 3}


def tf_log_level(debug: bool) -> str:
    """The value for ``TF_CPP_MIN_LOG_LEVEL``: all of it for debug, else the user's own or
    quiet."""
    return "0" if debug else os.environ.get(ENV, QUIET)


def set_tf_log_level(debug: bool) -> None:
    """For this process and the Ray workers it starts (``shards.cluster`` passes it on)."""
    os.environ[ENV] = tf_log_level(debug)


def min_level() -> int:
    try:
        return int(os.environ.get(ENV, "0"))
    except ValueError:
        return 0


def import_tensorflow() -> ModuleType:
    """``import tensorflow``, its start-up lines held to ``TF_CPP_MIN_LOG_LEVEL`` as well.

    Every TensorFlow of the shards package comes through here (resolve task, shard actor, CLI),
    so the allocator is chosen here too, before any op runs: a Ray worker that partitioned a
    model may be started as a shard actor next (``heap_trim.use_system_allocator``).

    Whatever else reaches stderr meanwhile (another thread, a fatal error) is written out
    afterwards. A process that dies inside the import loses the held lines: ``--log-level
    debug`` imports with nothing held.
    """
    use_system_allocator()
    level = min_level()
    if "tensorflow" in sys.modules or level <= 0:
        import tensorflow

        return tensorflow
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            import tensorflow
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = filter_lines(held.read(), level)
            if kept:
                os.write(2, kept)
    return tensorflow


def filter_lines(text: bytes, level: int) -> bytes:
    """``text`` without absl records below ``level`` (and the lines that continue them)."""
    kept: list[bytes] = []
    dropping = False
    for line in text.splitlines(keepends=True):
        record = _RECORD.match(line)
        if record:
            dropping = _SEVERITY[record.group(1)] < level
        elif line.startswith(_PREFACE):
            dropping = True
        if not dropping:
            kept.append(line)
    return b"".join(kept)
