"""``python -m bench datapath``: what moves between the shards of ResNet50 (weights=None) and
of a small U-Net (skips that span stages) in K stages, what it costs in throughput, and what
reduced precision costs in accuracy, measured side by side in one run.

Modes, each on its own K actors of a private local Ray, the same batches:

- ``dicts``: the routing before issue 12, kept here as a bench-only actor: each stage receives
  the whole output dicts of the stages it reads from (a skip tensor rides through), and the output
  stages send all their outputs back to the driver;
- ``tensors``: one reference per tensor (``shards.pipeline.replica.Replica``);
- ``tensors+bf16`` / ``tensors+fp16``: the same with ``--activation-dtype``;
- ``weights bf16`` / ``weights fp16``: ``--weight-dtype``, activations float32.

Bytes moved per batch: every array a stage receives plus what comes back to the driver, as
counted by the actors. Throughput: windows of batches kept ``K + 1`` in flight, each mode's
windows alternating with those of ``tensors``, which stays up beside it (the machine is shared:
only ratios taken over the same minutes mean something). Accuracy: the logits
(``classifier_activation=None``) against the float32 ``tensors`` mode's, max abs and max abs over
max |logit|, and top-1 agreement.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import options
from bench.systems.actors import local_ray, partition_in_child
from shards.actor.stage_actor import ShardActor

MiB = 2**20
MODES: dict[str, dict[str, Any]] = {
    "dicts": {},
    "tensors": {},
    "tensors+bf16": {"activation_dtype": "bfloat16"},
    "tensors+fp16": {"activation_dtype": "float16"},
    "weights bf16": {"weight_dtype": "bfloat16"},
    "weights fp16": {"weight_dtype": "float16"},
}


@dataclass(frozen=True)
class DatapathPlan:
    image: int = 96
    models: tuple[str, ...] = ("resnet50", "unet")
    # U-Net: its skips cross stages, so only the routing modes are run on it.
    unet_modes: tuple[str, ...] = ("dicts", "tensors")
    batch: int = 8
    batches: int = 8
    rounds: int = 3
    stages: int = 4
    modes: tuple[str, ...] = tuple(MODES)
    workdir: Path = Path(".bench/datapath")

    def __post_init__(self) -> None:
        unknown = [m for m in (*self.modes, *self.unet_modes) if m not in MODES]
        if unknown:
            raise ValueError(f"unknown modes {unknown}; known: {', '.join(MODES)}")


class DictShard(ShardActor):
    """The stage actor as it was before per-tensor routing: whole dicts in, one dict out."""

    def forward_dicts(self, *parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        merged: dict[str, np.ndarray] = {}
        for part in parts:
            merged.update(part)
        self._dict_bytes = getattr(self, "_dict_bytes", 0) + sum(v.nbytes for v in merged.values())
        out = self.forward(*(merged[t.name] for t in self._spec.inputs))
        values = out if isinstance(out, tuple) else (out,)
        return dict(zip((t.name for t in self._spec.outputs), values, strict=True))

    def dict_bytes_in(self) -> int:
        return int(getattr(self, "_dict_bytes", 0))


def build(name: str, image: int) -> Any:
    """ResNet50 (its cuts carry one tensor each), or a small U-Net whose skips span stages."""
    import keras

    if name == "resnet50":
        return keras.applications.ResNet50(
            weights=None, input_shape=(image, image, 3), classifier_activation=None
        )
    if name != "unet":
        raise ValueError(f"unknown bench model {name!r}; known: resnet50, unet")
    keras.utils.set_random_seed(0)
    x = inputs = keras.Input((image, image, 3), name="image")
    skips = []
    for i, width in enumerate((32, 64, 128)):
        x = keras.layers.Conv2D(width, 3, padding="same", activation="relu", name=f"enc{i}")(x)
        skips.append(x)
        x = keras.layers.MaxPooling2D(name=f"pool{i}")(x)
    x = keras.layers.Conv2D(256, 3, padding="same", activation="relu", name="mid")(x)
    for i, width in reversed(list(enumerate((32, 64, 128)))):
        x = keras.layers.UpSampling2D(name=f"up{i}")(x)
        x = keras.layers.Concatenate(name=f"cat{i}")([x, skips[i]])
        x = keras.layers.Conv2D(width, 3, padding="same", activation="relu", name=f"dec{i}")(x)
    return keras.Model(inputs, keras.layers.Conv2D(2, 1, name="mask")(x), name="unet")


class _DictPipeline:
    """The driver side of the old routing (shards/pipeline/replica.py before issue 12)."""

    def __init__(self, bundle: Path, batch: int) -> None:
        import ray

        from shards.bundle.format import read_manifest

        self.manifest = read_manifest(bundle)
        remote: Any = ray.remote(DictShard).options(num_cpus=1, max_concurrency=1)
        self.actors = [remote.remote(str(bundle), s.index, [batch]) for s in self.manifest.stages]
        producer = {n: -1 for n in self.manifest.signature.input_names}
        self.sources: list[tuple[bool, list[int]]] = []
        for stage in self.manifest.stages:
            found = {producer[t.name] for t in stage.inputs}
            self.sources.append((-1 in found, sorted(found - {-1})))
            producer.update({t.name: stage.index for t in stage.outputs})
        self.output_stages = sorted({producer[n] for n in self.manifest.signature.output_names})
        self.returned = 0

    async def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        refs: list[Any] = []
        for actor, (needs_request, stages) in zip(self.actors, self.sources, strict=True):
            parts = ([inputs] if needs_request else []) + [refs[j] for j in stages]
            refs.append(actor.forward_dicts.remote(*parts))
        results = await asyncio.gather(*(refs[s] for s in self.output_stages))
        merged = {k: v for r in results for k, v in r.items()}
        self.returned += sum(v.nbytes for v in merged.values())
        return {n: merged[n] for n in self.manifest.signature.output_names}

    async def bytes_moved(self) -> int:
        return sum([await a.dict_bytes_in.remote() for a in self.actors]) + self.returned

    async def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)


class _TensorPipeline:
    def __init__(self, group: Any) -> None:
        self.group = group
        self.returned = 0

    async def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = await self.group.run(inputs)
        self.returned += sum(v.nbytes for v in out.values())
        return out

    async def bytes_moved(self) -> int:
        stats = [await a.stats.remote() for a in self.group._pipelines[0].actors]
        return sum(int(s["bytes_in_total"]) for s in stats) + self.returned

    async def close(self) -> None:
        await self.group.close()


async def _start(mode: str, bundle: Path, plan: DatapathPlan) -> Any:
    from shards.pipeline.replica_set import PipelineOptions, ReplicaSet

    if mode == "dicts":
        runner = _DictPipeline(bundle, plan.batch)
        await asyncio.gather(*(a.info.remote() for a in runner.actors))
        return runner
    options = PipelineOptions(batch_sizes=(plan.batch,), cpus_per_shard=1.0, **MODES[mode])
    return _TensorPipeline(await ReplicaSet.create(bundle, options))


async def _rate(runner: Any, batch: dict[str, np.ndarray], plan: DatapathPlan) -> float:
    """Rows per second over one window of ``plan.batches`` batches, K + 1 in flight."""
    places = asyncio.Semaphore(plan.stages + 1)

    async def one() -> None:
        async with places:
            await runner.run(batch)

    tick = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(plan.batches)))
    return plan.batches * plan.batch / (time.perf_counter() - tick)


async def _modes(
    bundle: Path, plan: DatapathPlan, batch: dict[str, np.ndarray], wanted: list[str], say: Any
) -> dict[str, Any]:
    """Each mode against ``tensors`` (float32, per tensor), which stays up the whole time: their
    windows alternate, so a ratio compares the same minutes of a busy machine."""
    base = await _start("tensors", bundle, plan)
    results: dict[str, Any] = {}
    try:
        reference = next(iter((await base.run(batch)).values()))
        base_rates: list[float] = []
        for mode in wanted:
            if mode == "tensors":
                continue
            tick = time.monotonic()
            other = await _start(mode, bundle, plan)
            try:
                logits = next(iter((await other.run(batch)).values()))
                before = await other.bytes_moved()
                ratios, rates = [], []
                for _ in range(plan.rounds):
                    base_rate = await _rate(base, batch, plan)
                    rate = await _rate(other, batch, plan)
                    base_rates.append(base_rate)
                    rates.append(rate)
                    ratios.append(rate / base_rate)
                moved = (await other.bytes_moved() - before) / (plan.rounds * plan.batches)
            finally:
                await other.close()
            results[mode] = {
                "bytes_per_batch": moved,
                "rows_per_s": statistics.median(rates),
                "vs_tensors": statistics.median(ratios),
                "accuracy": _accuracy(logits, reference),
            }
            say(
                f"{mode}: {moved / MiB:.2f} MiB/batch, {results[mode]['rows_per_s']:.1f} rows/s, "
                f"{results[mode]['vs_tensors']:.2f}x tensors "
                f"({time.monotonic() - tick:.0f} s)"
            )
        before = await base.bytes_moved()
        base_rates.append(await _rate(base, batch, plan))
        results["tensors"] = {
            "bytes_per_batch": (await base.bytes_moved() - before) / plan.batches,
            "rows_per_s": statistics.median(base_rates),
            "vs_tensors": 1.0,
            "accuracy": _accuracy(reference, reference),
        }
    finally:
        await base.close()
    return {m: results[m] for m in wanted if m in results}


def _say(progress: Any, model: str, line: str) -> None:
    progress(f"{model} {line}")


def _accuracy(logits: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    err = np.abs(logits.astype(np.float64) - reference.astype(np.float64))
    return {
        "max_abs": float(err.max()),
        "max_rel": float(err.max() / np.abs(reference).max()),
        "top1_agree": float((logits.argmax(-1) == reference.argmax(-1)).mean()),
    }


def run(plan: DatapathPlan, progress: Any = print) -> dict[str, Any]:
    from shards.bundle.format import read_manifest

    plan.workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"plan": options.plan_json(plan)}
    with local_ray(2 * plan.stages):  # the tensors baseline's actors beside the mode's
        for model in plan.models:
            bundle = plan.workdir / f"{model}-{plan.image}px-{plan.stages}st"
            if not (bundle / "manifest.json").is_file():
                partition_in_child(__name__, (model, plan.image), bundle, plan.stages)
            name = read_manifest(bundle).signature.input_names[0]
            rng = np.random.default_rng(0)
            image = rng.uniform(0, 255, size=(plan.batch, plan.image, plan.image, 3))
            batch = {name: image.astype("float32")}
            wanted = plan.modes if model == "resnet50" else plan.unet_modes
            modes = [m for m in plan.modes if m in wanted]
            results[model] = asyncio.run(
                _modes(bundle, plan, batch, modes, functools.partial(_say, progress, model))
            )
    return results


def render(results: dict[str, Any]) -> str:
    plan = results["plan"]
    lines = [
        f"{plan['image']}x{plan['image']}x3 input, {plan['stages']} stages, batch "
        f"{plan['batch']}, windows of {plan['batches']} batches with {plan['stages'] + 1} in "
        f"flight, {plan['rounds']} rounds alternating with `tensors`; errors "
        "against the float32 `tensors` mode's outputs (ResNet50: logits; U-Net: per-pixel)",
        "",
        "| model | mode | MiB moved per batch | vs dicts | rows/s | vs tensors, same windows | "
        "max abs err | max err / max out | top-1 agree |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model in plan["models"]:
        lines += _rows(model, results.get(model, {}))
    return "\n".join(lines) + "\n"


def _rows(model: str, modes: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    base: dict[str, Any] = modes.get("dicts") or modes["tensors"]
    for mode, m in modes.items():
        acc = m["accuracy"] or {}
        lines.append(
            f"| {model} | {mode} | {m['bytes_per_batch'] / MiB:.2f} | "
            f"{m['bytes_per_batch'] / base['bytes_per_batch']:.2f}x | {m['rows_per_s']:.1f} | "
            f"{m['vs_tensors']:.2f}x | {acc.get('max_abs', float('nan')):.3g} | "
            f"{acc.get('max_rel', float('nan')):.3g} | {acc.get('top1_agree', float('nan')):.2f} |"
        )
    return lines


def add_parsers(sub: Any) -> None:
    about = "bytes between shards, routing and 16-bit precision"
    opts = options.suite(
        sub, "datapath", about, out="docs/bench-datapath", plan=DatapathPlan, run=run, render=render
    )
    opts.own("--image", type=int)
    opts.add("models")
    opts.own("--batch", type=int)
    opts.own("--batches", type=int)
    opts.own("--rounds", type=int)
    opts.add("stages")
    opts.own("--modes", type=options.csv)
    opts.own("--unet-modes", type=options.csv)
    opts.add("workdir")
