"""The default device budget (issue 29): where the cluster has GPUs and no budget was given, one
GPU's memory, so that a layer larger than a GPU is split rather than run out of memory. Tested on
this GPU-less machine through a Ray that declares GPUs, with the GPU's memory given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

# A driver of its own: the session's Ray declares no GPUs.
_SCRIPT = """
import json
import ray
from serving.settings.config import Settings
from serving.version.runner import device_budget

ray.init(address="local", num_cpus=1, num_gpus=2, include_dashboard=False)
given = Settings(model="demo-tiny", gpu_memory_bytes="600KB")
found = {
    "gpu": device_budget(given),
    "half_a_gpu": device_budget(given.model_copy(update={"gpus_per_shard": 0.5})),
    "budget_given": device_budget(given.model_copy(update={"max_stage_bytes": [1000]})),
    "stages_given": device_budget(given.model_copy(update={"stages": 2})),
    "no_gpus": device_budget(given.model_copy(update={"gpus_per_shard": 0})),
    # No nvidia-smi on this machine: the GPU task says so, and no budget is set.
    "not_asked": device_budget(Settings(model="demo-tiny")),
}
print("RESULT " + json.dumps(found))
ray.shutdown()
"""


def test_the_gpus_memory_is_the_budget_where_none_was_given(tmp_path: Path) -> None:
    script = tmp_path / "budget.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("SHARDSERVE_GPU_MEMORY_BYTES", None)
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    found = json.loads(lines[-1].removeprefix("RESULT "))
    assert found == {
        "gpu": [600_000],
        "half_a_gpu": [300_000],
        "budget_given": [1000],
        "stages_given": None,
        "no_gpus": None,
        "not_asked": None,
    }
