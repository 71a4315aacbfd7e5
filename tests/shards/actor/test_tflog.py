"""TensorFlow's C++ log is quiet unless asked for: ``shardserve plan`` on a CPU machine prints
no cuInit error and none of TensorFlow's start-up lines; ``--log-level debug`` lets all through."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shards.actor.tflog import filter_lines, tf_log_level

SHARDSERVE = str(Path(sys.executable).parent / "shardserve")
ABSL_RECORD = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\] ", re.MULTILINE)

STARTUP = (
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    b"I0000 00:00:1795440286.665150    5835 port.cc:153] oneDNN custom operations are on.\n"
    b"plain line from another thread\n"
    b"I0515 13:24:28.123456    5835 cpu_feature_guard.cc:227] This TensorFlow binary is ...\n"
    b"To enable the following instructions: AVX2 FMA, rebuild TensorFlow.\n"
    b"E0000 00:00:1795440290.889532    5835 cuda_platform.cc:52] failed call to cuInit\n"
    b"F0000 00:00:1795440290.889532    5835 cpu_feature_guard.cc:1] fatal\n"
)


def test_filter_keeps_what_is_at_or_above_the_level_and_everything_else() -> None:
    assert filter_lines(STARTUP, 3) == (
        b"F0000 00:00:1795440290.889532    5835 cpu_feature_guard.cc:1] fatal\n"
    )
    kept = filter_lines(STARTUP, 2).decode()
    assert "cuInit" in kept and "oneDNN" not in kept and "To enable" not in kept
    assert filter_lines(b"plain line\n" + STARTUP, 3).startswith(b"plain line\n")


def _plan() -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU machine, also where a GPU is installed
    return subprocess.run(
        [SHARDSERVE, "plan", "demo-tiny"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_plan_prints_no_tensorflow_log() -> None:
    quiet = _plan()
    assert quiet.returncode == 0, quiet.stderr
    assert "dense_0" in quiet.stdout  # the plan itself
    assert "cuInit" not in quiet.stderr and not ABSL_RECORD.search(quiet.stderr), quiet.stderr
    assert "absl::InitializeLog" not in quiet.stderr, quiet.stderr


def test_debug_shows_everything_and_a_users_own_level_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    assert (tf_log_level(debug=True), tf_log_level(debug=False)) == ("0", "3")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    assert (tf_log_level(debug=True), tf_log_level(debug=False)) == ("0", "1")
