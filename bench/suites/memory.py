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

import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import options
from bench.systems.actors import cpu_only_env, local_ray, partition_in_child

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
        return _mlp(keras, 4096, 18, 0.01, "mlp_1_2g")
    if name == "mlp-1.2g-narrow":
        # 2048 features, 72 hidden layers of 2048: the same 1.21 GB in 17 MB layers, under
        # glibc's mmap threshold, so what loading frees stays in the heap unless it is trimmed.
        return _mlp(keras, 2048, 72, 0.02, "mlp_1_2g_narrow")
    if name == "tiny":  # for the bench's smoke test
        features = keras.Input((64,), name="features")
        hidden = keras.layers.Dense(64, name="d0")(features)
        return keras.Model(features, keras.layers.Dense(4, name="d1")(hidden), name="tiny")
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3))
    raise ValueError(
        f"unknown bench model {name!r}; known: {', '.join(MODELS)}, mlp-1.2g-narrow, tiny"
    )


def _mlp(keras: Any, width: int, depth: int, scale: float, name: str) -> Any:
    """``width`` features, ``depth`` hidden ReLU layers of ``width``, 10 logits."""
    x = features = keras.Input((width,), name="features")
    for i in range(depth):
        init = keras.initializers.RandomUniform(-scale, scale, seed=i)
        x = keras.layers.Dense(width, activation="relu", kernel_initializer=init, name=f"d{i}")(x)
    return keras.Model(features, keras.layers.Dense(10, name="logits")(x), name=name)


def start_bare_tensorflow() -> subprocess.Popen[str]:
    """The bare process, started now: it imports while Ray starts (its RSS is its own)."""
    return subprocess.Popen(
        [sys.executable, "-c", _BARE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cpu_only_env(),
    )


def bare_tensorflow_rss(bare: subprocess.Popen[str]) -> int:
    out, err = bare.communicate()
    if bare.returncode != 0:
        raise RuntimeError(f"the bare `import tensorflow, keras` process failed: {err[-1500:]}")
    return int(out.strip().splitlines()[-1])


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
    plan.workdir.mkdir(parents=True, exist_ok=True)
    bare_process = start_bare_tensorflow()
    results: dict[str, Any] = {"models": {}}
    with local_ray(plan.stages):
        for name in plan.models:
            batch = plan.mlp_batch if name.startswith("mlp") else plan.resnet_batch
            with tempfile.TemporaryDirectory(dir=plan.workdir) as tmp:
                bundle = Path(tmp) / "bundle"
                tick = time.monotonic()
                partition_in_child(__name__, (name,), bundle, plan.stages, batch)
                progress(f"{name}: partitioned in {time.monotonic() - tick:.0f} s")
                tick = time.monotonic()
                rows = measure_model(bundle, batch)
                progress(f"{name}: {len(rows)} actors measured in {time.monotonic() - tick:.0f} s")
            results["models"][name] = {"batch": batch, "stages": rows}
    results["bare_tf_rss"] = bare = bare_tensorflow_rss(bare_process)
    progress(f"bare `import tensorflow, keras` process: {bare / MiB:.0f} MiB RSS")
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
    opts = options.suite(
        sub, "memory", about, out="docs/bench-memory", plan=MemoryPlan, run=run, render=render
    )
    opts.add("models", "stages")
    opts.own("--mlp-batch", type=int)
    opts.own("--resnet-batch", type=int)
    opts.add("workdir")
