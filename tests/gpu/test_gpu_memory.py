"""On a GPU: the shard actors report TensorFlow's GPU memory beside their plan, and a plan made
where TensorFlow sees a GPU counts the GPU overhead (1 GiB).

Its own Ray in a subprocess, like test_gpu_shards.py: the session's Ray declares no GPUs.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.serverproc import ray_env

_SCRIPT = """
import asyncio, json, tempfile
from pathlib import Path
import ray
from shards.pipeline.replica_set import ReplicaSet, PipelineOptions
from shards.source.resolve import ResolveOptions, resolve_bundle

ray.init(address="local", include_dashboard=False)
bundle = resolve_bundle("demo-mlp", ResolveOptions(stages=1, max_stage_bytes=None, cache_dir=Path(tempfile.mkdtemp())))

async def main():
    group = await ReplicaSet.create(bundle, PipelineOptions(batch_sizes=(32,)))
    infos = await group.describe()
    await group.close()
    return infos

print(json.dumps(asyncio.run(main()), default=str))
"""


def test_gpu_actor_reports_its_gpu_memory_beside_the_plan() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=ray_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (info,) = json.loads(done.stdout.strip().splitlines()[-1])
    memory = info["memory"]
    assert "GPU" in info["device"]
    assert memory["gpu"]["peak"] >= memory["weight_bytes"] > 0  # the weights live on the GPU
    # weights (126 MB) + activations + the 1 GiB GPU overhead: planned where TF sees the GPU
    assert memory["planned_peak_bytes"] > 2**30 + memory["weight_bytes"]
