"""``python -m bench memory``: the memory plan against what each shard actor really holds.

For each model: partition it (in a subprocess, so this process stays small), start one
``ShardActor`` per stage on a private local Ray, warm each at the max batch size, and read the
actor's own memory report (``ShardActor.info()["memory"]``). A bare ``import tensorflow, keras``
process, started in the same run, is the baseline "above a bare TensorFlow process" is taken
from. Per stage it prints:

- planned: the plan's peak (weights + activations at the max batch + device overhead);
- measured: the actor's RSS after loading and warm-up, and its peak (VmHWM, loading included);
- measured / planned (now and at the peak; target within 25%), and (RSS - bare TF) / weights:
  issue 12's lean-loading target is <= 1.25x.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import options

MiB = 2**20
MODELS = ("mlp-1.2g", "resnet50")  # and "mlp-1.2g-narrow"; "tiny", for the smoke test
_BARE = (
    "import tensorflow, keras, pathlib; "
    "s = pathlib.Path('/proc/self/status').read_text(); "
    "print([int(l.split()[1]) * 1024 for l in s.splitlines() if l.startswith('VmRSS')][0])"
)


@dataclass(frozen=True)
class MemoryPlan:
    models: tuple[str, ...] = MODELS
    stages: int = 4
    mlp_batch: int = 32
    resnet_batch: int = 8
    workdir: Path = Path(".bench/memory")


def build(name: str) -> Any:
    """The bench's models, built in code (no downloads)."""
    import keras

    if name == "mlp-1.2g":
        # 4096 features, 18 hidden layers of 4096: 302M parameters, 1.21 GB (issue 12's MLP).
        features = keras.Input((4096,), name="features")
        x = features
        for i in range(18):
            init = keras.initializers.RandomUniform(-0.01, 0.01, seed=i)
            x = keras.layers.Dense(4096, activation="relu", kernel_initializer=init, name=f"d{i}")(
                x
            )
        logits = keras.layers.Dense(10, name="logits")(x)
        return keras.Model(features, logits, name="mlp_1_2g")
    if name == "mlp-1.2g-narrow":
        # 2048 features, 72 hidden layers of 2048: the same 1.21 GB in 17 MB layers, under
        # glibc's mmap threshold, so what loading frees stays in the heap unless it is trimmed.
        features = keras.Input((2048,), name="features")
        x = features
        for i in range(72):
            init = keras.initializers.RandomUniform(-0.02, 0.02, seed=i)
            x = keras.layers.Dense(2048, activation="relu", kernel_initializer=init, name=f"d{i}")(
                x
            )
        logits = keras.layers.Dense(10, name="logits")(x)
        return keras.Model(features, logits, name="mlp_1_2g_narrow")
    if name == "tiny":  # for the bench's smoke test
        features = keras.Input((64,), name="features")
        hidden = keras.layers.Dense(64, name="d0")(features)
        return keras.Model(features, keras.layers.Dense(4, name="d1")(hidden), name="tiny")
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3))
    raise ValueError(
        f"unknown bench model {name!r}; known: {', '.join(MODELS)}, mlp-1.2g-narrow, tiny"
    )


def _partition_in_subprocess(name: str, out: Path, stages: int, batch: int) -> None:
    code = (
        "import sys; from bench.suites.memory import build; "
        "from shards.partition.cut import partition_to_bundle; "
        f"partition_to_bundle(build({name!r}), {str(out)!r}, stages={stages}, "
        f"max_batch_size={batch}, source_name={name!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())


def _env() -> dict[str, str]:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}


def bare_tensorflow_rss() -> int:
    out = subprocess.run(
        [sys.executable, "-c", _BARE], check=True, capture_output=True, text=True, env=_env()
    )
    return int(out.stdout.strip().splitlines()[-1])


def measure_model(bundle: Path, batch: int) -> list[dict[str, Any]]:
    """Start every stage's actor (one at a time: loading is the peak), read their reports."""
    import ray

    from shards.actor.stage_actor import ShardActor
    from shards.bundle.format import read_manifest

    manifest = read_manifest(bundle)
    remote: Any = ray.remote(ShardActor).options(num_cpus=1)
    actors, rows = [], []
    for spec in manifest.stages:
        actor = remote.remote(str(bundle), spec.index, [batch])
        info = ray.get(actor.info.remote())
        actors.append(actor)
        memory = info["memory"]
        rows.append(
            {
                "stage": spec.index,
                "layers": f"{spec.memory.first_layer}..{spec.memory.last_layer}"
                if spec.memory
                else "?",
                "weights": spec.param_bytes,
                "activations": spec.memory.activation_bytes if spec.memory else 0,
                "overhead": spec.memory.overhead_bytes if spec.memory else 0,
                "planned": spec.planned_peak_bytes,
                "rss": memory["rss_bytes"],
                "rss_peak": memory["rss_peak_bytes"],
                "marks": memory["rss_marks"],
            }
        )
    for actor in actors:
        ray.kill(actor)
    return rows


def run(plan: MemoryPlan, progress: Any = print) -> dict[str, Any]:
    import ray

    plan.workdir.mkdir(parents=True, exist_ok=True)
    bare = bare_tensorflow_rss()
    progress(f"bare `import tensorflow, keras` process: {bare / MiB:.0f} MiB RSS")
    results: dict[str, Any] = {"bare_tf_rss": bare, "models": {}}
    ray.init(
        address="local",
        num_cpus=plan.stages,
        include_dashboard=False,
        runtime_env={"env_vars": {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}},
    )
    try:
        for name in plan.models:
            batch = plan.mlp_batch if name.startswith("mlp") else plan.resnet_batch
            with tempfile.TemporaryDirectory(dir=plan.workdir) as tmp:
                bundle = Path(tmp) / "bundle"
                tick = time.monotonic()
                _partition_in_subprocess(name, bundle, plan.stages, batch)
                progress(f"{name}: partitioned in {time.monotonic() - tick:.0f} s")
                tick = time.monotonic()
                rows = measure_model(bundle, batch)
                progress(f"{name}: {len(rows)} actors measured in {time.monotonic() - tick:.0f} s")
            results["models"][name] = {"batch": batch, "stages": rows}
    finally:
        ray.shutdown()
    return results


def render(results: dict[str, Any]) -> str:
    bare = results["bare_tf_rss"]
    lines = [
        f"bare `import tensorflow, keras` process: {bare / MiB:.0f} MiB RSS",
        "",
        "| model | stage | layers | weights MiB | planned peak MiB (act + overhead) | measured "
        "RSS MiB (peak) | measured / planned | peak / planned | RSS above bare TF / weights | "
        "above own TF mark / weights |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, model in results["models"].items():
        for row in model["stages"]:
            w = row["weights"]
            above_bare = (row["rss"] - bare) / w if w else float("nan")
            above_mark = (row["rss"] - row["marks"]["tensorflow"]) / w if w else float("nan")
            lines.append(
                f"| {name} (batch {model['batch']}) | {row['stage']} | {row['layers']} | "
                f"{w / MiB:.0f} | {row['planned'] / MiB:.0f} ({row['activations'] / MiB:.0f} + "
                f"{row['overhead'] / MiB:.0f}) | {row['rss'] / MiB:.0f} "
                f"({row['rss_peak'] / MiB:.0f}) | {row['rss'] / row['planned']:.2f}x | "
                f"{row['rss_peak'] / row['planned']:.2f}x | "
                f"{above_bare:.2f}x | {above_mark:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def add_parsers(sub: Any) -> None:
    about = "memory plan vs each shard actor's measured RSS"
    parser = options.suite(
        sub, "memory", about, out="docs/bench-memory", plan=MemoryPlan, run=run, render=render
    )
    d = MemoryPlan()
    options.add(parser, d, "models", "stages")
    parser.add_argument("--mlp-batch", type=int, default=d.mlp_batch)
    parser.add_argument("--resnet-batch", type=int, default=d.resnet_batch)
    options.add(parser, d, "workdir")
