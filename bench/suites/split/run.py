"""The split bench's plan, layouts and rounds: partition each layout once, then per round
serve each in turn (the order reversed every other round), one at a time, and keep the
medians."""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import options
from bench.suites.split.crossing import crossing, store_created
from bench.suites.split.models import inputs
from bench.systems.actors import cpu_only_env, local_ray

MODELS = ("tables", "mlp")
TIED = "tied"  # a tied table held twice / held once (``tied``): run alone, --rows x --dim
ONE = "one stage"


@dataclass(frozen=True)
class Layout:
    name: str
    split: bool  # under the split budget, else one stage
    combine: str = "dense"  # a table's lookup combine
    pair: bool = True  # fc1 -> fc2 paired (False: each split by columns alone)


LAYOUTS = {
    "tables": (
        Layout(ONE, False),
        Layout("split, dense combine", True),
        Layout("split, routed combine", True, combine="routed"),
    ),
    "mlp": (
        Layout(ONE, False),
        Layout("split, paired", True),
        Layout("split, unpaired", True, pair=False),
    ),
}
# Per model, the two split layouts set against each other: (this, over that).
VERSUS = {
    "tables": ("split, routed combine", "split, dense combine"),
    "mlp": ("split, paired", "split, unpaired"),
}


@dataclass(frozen=True)
class SplitPlan:
    models: tuple[str, ...] = MODELS
    rows: int = 1_048_576  # per table: 128 MiB at dim 32
    dim: int = 32
    width: int = 1024  # the MLP's input and output units
    hidden: int = 32_768  # its hidden units: fc1 and fc2 128 MiB each at width 1024
    budget_share: float = 0.6  # the split budget, as a share of one table's (or fc1's) bytes
    # 64 rows: a dense table part's history lookup (160 KiB) and the MLP's partial sums (256
    # KiB) go through Ray's store, a routed part's (~82 KiB) stays inline (crossing.py).
    batch: int = 64
    concurrency: int = 4
    seconds: float = 6.0
    warmup_s: float = 2.0
    repeats: int = 3
    workdir: Path = Path(".bench/split")

    def __post_init__(self) -> None:
        if self.rows < 16 or self.dim < 1:
            raise ValueError(f"--rows must be >= 16 and --dim >= 1, got {self.rows}, {self.dim}")
        if not 0.05 <= self.budget_share < 1.0:
            raise ValueError(f"--budget-share must be in [0.05, 1), got {self.budget_share}")
        if self.models != (TIED,) and (
            not self.models or any(m not in MODELS for m in self.models)
        ):
            raise ValueError(
                f"--models is some of {','.join(MODELS)}, or {TIED} alone, got {self.models!r}"
            )
        options.require(self, at_least_one=("batch", "concurrency", "repeats"))
        options.require(self, positive=("seconds",))


def layer_bytes(plan: SplitPlan, model: str) -> int:
    """The bytes of the layer the budget is a share of: one table, or fc1."""
    return plan.width * plan.hidden * 4 if model == "mlp" else plan.rows * plan.dim * 4


def _partition(plan: SplitPlan, jobs: list[tuple[str, Layout, Path]]) -> None:
    """Each (model, layout, out) partitioned, in one child (one TensorFlow import for all)."""
    calls = []
    for model, layout, out in jobs:
        builder = (
            f"build_mlp({plan.width}, {plan.hidden})"
            if model == "mlp"
            else f"build({plan.rows}, {plan.dim})"
        )
        budget = int(layer_bytes(plan, model) * plan.budget_share)
        how = f"max_stage_bytes={budget}" if layout.split else "stages=1"
        calls.append(
            f"partition_to_bundle({builder}, {str(out)!r}, {how}, "
            f"lookup_combine={layout.combine!r}, pair_dense={layout.pair}, "
            f"plan_batch_rows={plan.batch}, device_overhead_bytes=0, "
            f"source_name='split_{model}'); print('partitioned', {str(out)!r}, flush=True)"
        )
    partition_in_child("from bench.suites.split.models import build, build_mlp", calls)


def partition_in_child(builders: str, calls: list[str]) -> None:
    """``calls`` of ``partition_to_bundle`` (source lines) run in one child, after the import
    line ``builders``: one TensorFlow import for all, none in this process."""
    code = "\n".join([builders, "from shards.partition.cut import partition_to_bundle", *calls])
    subprocess.run([sys.executable, "-c", code], check=True, env=cpu_only_env())


async def _load(group: Any, batches: list[Any], callers: int, seconds: float) -> list[float]:
    """Each batch's latency (s) under ``seconds`` of closed-loop load from ``callers``."""
    latencies: list[float] = []
    stop = time.monotonic() + seconds

    async def caller(k: int) -> None:
        n = k
        while time.monotonic() < stop:
            tick = time.perf_counter()
            await group.run(batches[n % len(batches)])
            latencies.append(time.perf_counter() - tick)
            n += callers

    await asyncio.gather(*(caller(k) for k in range(callers)))
    return latencies


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _measure(group: Any, manifest: Any, plan: SplitPlan, model: str) -> dict[str, Any]:
    """One window of one layout: its figures, the store's bytes per batch under load, each
    actor's memory against its plan, and the 1-min load average before and after."""
    planned = {s.name: s.planned_peak_bytes for s in manifest.stages}
    batches = [inputs(model, plan.batch, plan.rows, plan.width, seed) for seed in range(8)]
    load_before = os.getloadavg()[0]
    await _load(group, batches, plan.concurrency, plan.warmup_s)
    objects, stored = store_created()
    loaded = await _load(group, batches, plan.concurrency, plan.seconds)
    objects_after, stored_after = store_created()
    alone = await _load(group, batches, 1, max(1.0, plan.seconds / 4))
    load_after = os.getloadavg()[0]
    actors = [
        {
            "stage": info["stage"],
            "planned": planned[info["stage"]],
            "rss": info["memory"]["rss_bytes"],
            "rss_peak": info["memory"]["rss_peak_bytes"],
            "tf_mark": info["memory"]["rss_marks"]["tensorflow"],
            "shm": info["memory"].get("rss_shared_memory_bytes", 0),
            "weights": info["weight_bytes"],
        }
        for info in await group.describe()
    ]
    return {
        "stages": [s.name for s in manifest.stages],
        "rows_per_s": len(loaded) * plan.batch / plan.seconds,
        "p50_ms": 1000 * statistics.median(loaded),
        "p99_ms": 1000 * _quantile(loaded, 0.99),
        "alone_p50_ms": 1000 * statistics.median(alone),
        "store_bytes": (stored_after - stored) / len(loaded),
        "store_objects": (objects_after - objects) / len(loaded),
        "load": [load_before, load_after],
        "actors": actors,
        "crossing": crossing(manifest.stages, plan.batch),
    }


async def _rounds(
    plan: SplitPlan, model: str, bundles: dict[str, Path], progress: Any
) -> list[dict[str, Any]]:
    """Every layout of ``model`` served at once (an idle pipeline takes no CPU), then
    ``repeats`` rounds of one window each, the order reversed every other round."""
    from shards.bundle.format import read_manifest
    from shards.pipeline.options import PipelineOptions
    from shards.pipeline.replica_set import ReplicaSet

    layouts = LAYOUTS[model]
    tick = time.monotonic()
    started = await asyncio.gather(
        *(
            ReplicaSet.create(
                bundles[layout.name], PipelineOptions(replicas=1, batch_sizes=(plan.batch,))
            )
            for layout in layouts
        ),
        return_exceptions=True,
    )
    groups = {layout.name: g for layout, g in zip(layouts, started, strict=True)}
    try:
        for group in started:
            if isinstance(group, BaseException):
                raise group
        progress(f"{model}: {len(layouts)} layouts started in {time.monotonic() - tick:.0f} s")
        manifests = {name: read_manifest(bundles[name]) for name in groups}
        rounds = []
        for r in range(plan.repeats):
            found: dict[str, Any] = {}
            for layout in layouts if r % 2 == 0 else layouts[::-1]:
                name = layout.name
                found[name] = got = await _measure(groups[name], manifests[name], plan, model)
                progress(
                    f"round {r + 1}, {model}, {name}: {got['rows_per_s']:.0f} rows/s, p99 "
                    f"{got['p99_ms']:.1f} ms, store {got['store_bytes'] / 1024:.1f} KiB/batch, "
                    f"load {got['load'][0]:.1f}-{got['load'][1]:.1f}"
                )
            rounds.append({layout.name: found[layout.name] for layout in layouts})
        return rounds
    finally:
        for group in groups.values():
            if not isinstance(group, BaseException):
                await group.close()


def run(plan: SplitPlan, progress: Any = print) -> dict[str, Any]:
    if plan.models == (TIED,):
        from bench.suites.split import tied

        return tied.run(plan, progress)
    plan.workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"batch": plan.batch, "repeats": plan.repeats, "models": {}}
    with tempfile.TemporaryDirectory(dir=plan.workdir) as tmp:
        bundles = {
            (model, layout.name): Path(tmp) / f"{model}-{k}"
            for model in plan.models
            for k, layout in enumerate(LAYOUTS[model])
        }
        tick = time.monotonic()
        _partition(
            plan,
            [(m, layout, bundles[m, layout.name]) for m in plan.models for layout in LAYOUTS[m]],
        )
        progress(f"{len(bundles)} layouts partitioned in {time.monotonic() - tick:.0f} s")
        with local_ray(16):  # a logical CPU per actor: 13 at once for the tables
            for model in plan.models:
                mine = {name: path for (m, name), path in bundles.items() if m == model}
                rounds = asyncio.run(_rounds(plan, model, mine, progress))
                results["models"][model] = {
                    "layer_bytes": layer_bytes(plan, model),
                    "budget": int(layer_bytes(plan, model) * plan.budget_share),
                    "rounds": rounds,
                    **summarise(model, rounds),
                }
    return results


FIGURES = ("rows_per_s", "p50_ms", "p99_ms", "alone_p50_ms", "store_bytes", "store_objects")


def summarise(model: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds: each layout's figures, each actor's memory, and the ratios
    (each round's ratio, then their median: a ratio taken side by side in one round)."""

    def median(values: list[float]) -> float:
        return float(statistics.median(values))

    layouts: dict[str, Any] = {}
    for name in rounds[0]:
        seen = [r[name] for r in rounds]
        actors = []
        for k, actor in enumerate(seen[0]["actors"]):
            each = [s["actors"][k] for s in seen]
            actors.append(
                {
                    **actor,
                    **{
                        f: median([a[f] for a in each])
                        for f in ("rss", "rss_peak", "tf_mark", "shm")
                    },
                }
            )
        layouts[name] = {
            "stages": seen[0]["stages"],
            "crossing": seen[0]["crossing"],
            "load": [min(s["load"][0] for s in seen), max(s["load"][1] for s in seen)],
            "actors": actors,
            **{f: median([s[f] for s in seen]) for f in FIGURES},
        }

    def ratio(this: str, that: str, figure: str) -> float | None:
        pairs = [(r[this][figure], r[that][figure]) for r in rounds]
        if any(b == 0 for _, b in pairs):
            return None
        return median([a / b for a, b in pairs])

    over_one = {
        name: {f: ratio(name, ONE, f) for f in ("rows_per_s", "p50_ms", "p99_ms", "alone_p50_ms")}
        for name in layouts
        if name != ONE
    }
    this, that = VERSUS[model]
    versus = {f: ratio(this, that, f) for f in FIGURES}
    versus["computed_store"] = _share(layouts[this]["crossing"], layouts[that]["crossing"])
    return {"layouts": layouts, "over_one": over_one, "versus": versus}


def _share(this: dict[str, int], that: dict[str, int]) -> float | None:
    return this["store"] / that["store"] if that["store"] else None


def add_parsers(sub: Any) -> None:
    from bench.suites.split.report import render

    about = (
        "split layers against one stage: tables (dense / routed combine), an MLP fc1 -> fc2 "
        "(paired / unpaired); alone, a tied table (held twice / once): rows/s, p99, store bytes, "
        "RSS against the plan"
    )
    opts = options.suite(
        sub, "split", about, out="docs/bench-split", plan=SplitPlan, run=run, render=render
    )
    opts.add("models", help=f"comma-separated, of {','.join(MODELS)}; or {TIED} alone")
    opts.own("--rows", type=int, help="rows per table")
    opts.own("--dim", type=int)
    opts.own("--width", type=int, help="the MLP's input and output units")
    opts.own("--hidden", type=int, help="the MLP's hidden units")
    opts.own("--budget-share", type=float, help="the split budget, as a share of one table/fc1")
    opts.own("--batch", type=int, help="rows per batch (and the plan's batch)")
    opts.add("concurrency", "seconds", "warmup_s", "repeats", "workdir")
