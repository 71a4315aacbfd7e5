"""On a machine with GPUs: each shard actor gets its own GPU and TensorFlow really runs there.

Skipped with a reason where no GPU is visible (see tests/conftest.py). It starts its own Ray in
a subprocess, because the session's Ray declares no GPUs.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.serverproc import ray_env

_SCRIPT = """
import asyncio, json, tempfile
from pathlib import Path
import numpy as np
import ray
from shards.pipeline.replica_set import ReplicaSet, PipelineOptions
from shards.source.resolve import ResolveOptions, resolve_bundle

ray.init(address="local", include_dashboard=False)
stages = max(1, min(2, int(ray.cluster_resources().get("GPU", 0))))
bundle = resolve_bundle("demo-tiny", ResolveOptions(stages=stages, max_stage_bytes=None, cache_dir=Path(tempfile.mkdtemp())))

async def main():
    group = await ReplicaSet.create(bundle, PipelineOptions(batch_sizes=(1, 4)))
    x = np.ones((4, *group.signature.inputs[0].shape), dtype="float32")
    out = await group.run({group.signature.inputs[0].name: x})
    infos = await group.describe()
    await group.close()
    return {
        "infos": infos,
        "finite": bool(np.isfinite(out["logits"]).all()),
        "on_gpu": group.on_gpu,
    }

print(json.dumps(asyncio.run(main()), default=str))
"""


def test_each_shard_runs_on_its_own_gpu() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=ray_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    infos = result["infos"]
    assert result["on_gpu"]  # the server pads batches to buckets on GPU stages
    assert result["finite"]
    assert all("GPU" in info["device"] for info in infos), infos
    gpu_sets = [tuple(info["gpu_ids"]) for info in infos]
    assert all(gpu_sets) and len(set(gpu_sets)) == len(gpu_sets)  # one distinct GPU per stage
