"""``python -m bench split --models tied``: a tied table (keras_hub's ``ReversibleEmbedding``, the
lookup at the start and the logits at the end, as GPT-2's) too large for one device, split by
rows and served held twice (a set of part actors for the lookups, another for the logits) and
held once (one set: part k's actor runs its lookup and, in a Ray concurrency group of its own,
its logits, from one copy of its rows; issue 42), side by side in one run, with the same model
in one stage as the reference (``--models tied`` runs alone: its table is ``--rows`` x ``--dim``).

The model: ids ``[batch, 1]`` -> a ``--rows`` x ``--dim`` float32 table -> two ``Dense`` of
``--dim`` (gelu, then linear) -> the table's logits ``[batch, 1, rows]``, which the driver
joins from the parts. The budget is ``--budget-share`` of the table; the plan sizes each part
for its rows and its activations (held once: both uses' beside one share of the rows). The three
layouts are up at once and take turns (``ROUNDS`` rounds, ABBA order, ``--seconds`` split
between them, after ``--warmup`` each), so that a machine whose load drifts weighs on all alike. Each under ``--concurrency`` closed-loop
callers: rows/s (the pipeline's overlap: held once, batch n+1's lookup runs while batch n's
logits do, in the same process), p50/p99 of a batch, a batch alone; per process its RSS above
its TensorFlow import and its weights (a process running two stages counted once). The figures
to read: held once / held twice, rows/s (goal >= 0.9x, with each round's ratio) and the parts'
RSS.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.suites.split.report import MiB
from bench.suites.split.run import SplitPlan, _load, partition_in_child
from bench.systems.actors import local_ray

IMPORTS = ("keras_hub",)  # the stage files' ReversibleEmbedding

ROUNDS = 4


def build(rows: int, dim: int) -> Any:
    """ids -> a tied table of ``rows`` x ``dim`` -> two Dense -> the table's logits (seeded)."""
    import keras
    import keras_hub

    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=3)
    ids = keras.Input((1,), dtype="int32", name="ids")
    table = keras_hub.layers.ReversibleEmbedding(
        rows, dim, tie_weights=True, embeddings_initializer=init, name="tokens"
    )
    x = table(ids)
    x = keras.layers.Dense(dim, activation="gelu", kernel_initializer=init, name="mid")(x)
    x = keras.layers.Dense(dim, kernel_initializer=init, name="out")(x)
    logits = table(x, reverse=True)
    return keras.Model(ids, logits, name="split_tied")


LAYOUTS = (
    ("one stage", False, "once"),
    ("split, held twice", True, "twice"),
    ("split, held once", True, "once"),
)


def _partition(plan: SplitPlan, bundles: dict[str, Path], budget: int) -> None:
    """The three layouts partitioned in one child (this process loads no TensorFlow)."""
    calls = []
    for name, split, tied in LAYOUTS:
        how = f"max_stage_bytes={budget}" if split else "stages=1"
        calls.append(
            f"partition_to_bundle(build({plan.rows}, {plan.dim}), {str(bundles[name])!r}, {how}, "
            f"lookup_combine='dense', tied_tables={tied!r}, imports={list(IMPORTS)!r}, "
            f"plan_batch_rows={plan.batch}, device_overhead_bytes=0, source_name='split_tied')"
        )
    partition_in_child("from bench.suites.split.tied import build", calls)


def _batches(plan: SplitPlan) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {"ids": rng.integers(0, plan.rows, size=(plan.batch, 1)).astype("int32")} for _ in range(8)
    ]


def run(plan: SplitPlan, progress: Any = print) -> dict[str, Any]:
    plan.workdir.mkdir(parents=True, exist_ok=True)
    table = plan.rows * plan.dim * 4
    budget = int(table * plan.budget_share)
    results: dict[str, Any] = {"model": "tied", "table_bytes": table, "budget": budget}
    found: dict[str, Any] = {}
    # The three layouts up at once (1 + 5 + 3 actors, a host asking its guest's CPUs too: up to
    # 15 logical CPUs) beside the driver.
    with local_ray(24), tempfile.TemporaryDirectory(dir=plan.workdir) as tmp:
        bundles = {
            name: Path(tmp) / name.replace(" ", "_").replace(",", "") for name, _, _ in LAYOUTS
        }
        tick = time.monotonic()
        _partition(plan, bundles, budget)
        progress(f"{len(bundles)} layouts partitioned in {time.monotonic() - tick:.0f} s")
        measured, rounds = asyncio.run(_side_by_side(bundles, plan))
        found.update(measured)
        results["rounds"] = rounds
        for name, layout in found.items():
            layout["processes"] = processes(layout["actors"])
            progress(
                f"{name}: stages {', '.join(layout['stages'])} in {len(layout['processes'])} "
                f"process(es); {layout['rows_per_s']:.0f} rows/s, p99 {layout['p99_ms']:.1f} ms, "
                f"alone p50 {layout['alone_p50_ms']:.2f} ms"
            )
    results["layouts"] = found
    twice, once = found["split, held twice"], found["split, held once"]
    results["once_over_twice"] = {
        "rows_per_s": once["rows_per_s"] / twice["rows_per_s"],
        "rounds": [r["split, held once"] / r["split, held twice"] for r in rounds],
        "p50": once["p50_ms"] / twice["p50_ms"],
        "p99": once["p99_ms"] / twice["p99_ms"],
        "alone_p50": once["alone_p50_ms"] / twice["alone_p50_ms"],
        "parts_above_tf": _parts_above(once) / _parts_above(twice),
        "parts_weights": _parts_weights(once) / _parts_weights(twice),
    }
    return results


async def _side_by_side(
    bundles: dict[str, Path], plan: SplitPlan
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Each layout's figures, the layouts taking turns round by round (ABBA), and each round's
    rows/s by layout."""
    from shards.bundle.format import read_manifest
    from shards.pipeline.options import PipelineOptions
    from shards.pipeline.replica_set import ReplicaSet

    batches = _batches(plan)
    options = PipelineOptions(replicas=1, batch_sizes=(plan.batch,), imports=IMPORTS)
    groups = {name: await ReplicaSet.create(bundle, options) for name, bundle in bundles.items()}
    loaded: dict[str, list[float]] = {name: [] for name in groups}
    alone: dict[str, list[float]] = {name: [] for name in groups}
    rounds: list[dict[str, float]] = []
    window = plan.seconds / ROUNDS
    try:
        for group in groups.values():
            await _load(group, batches, plan.concurrency, plan.warmup_s)
        for r in range(ROUNDS):
            order = list(groups) if r % 2 == 0 else list(reversed(groups))
            found: dict[str, float] = {}
            for name in order:
                got = await _load(groups[name], batches, plan.concurrency, window)
                loaded[name] += got
                found[name] = len(got) * plan.batch / window
                alone[name] += await _load(groups[name], batches, 1, max(0.5, window / 4))
            rounds.append(found)
        infos = {name: await group.describe() for name, group in groups.items()}
    finally:
        for group in groups.values():
            await group.close()
    measured = {}
    for name, bundle in bundles.items():
        manifest = read_manifest(bundle)
        planned = {s.name: s.planned_peak_bytes for s in manifest.stages}
        ordered = sorted(loaded[name])
        measured[name] = {
            "stages": [s.name for s in manifest.stages],
            "rows_per_s": len(ordered) * plan.batch / plan.seconds,
            "p50_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "alone_p50_ms": 1000 * statistics.median(alone[name]),
            "actors": [
                {
                    "stage": info["stage"],
                    "planned": planned[info["stage"]],
                    "rss": info["memory"]["rss_bytes"],
                    "tf_mark": info["memory"]["rss_marks"]["tensorflow"],
                    "weights": info["weight_bytes"],
                    "pid": info["pid"],
                    "process_weights": info["memory"]["weight_bytes"],
                }
                for info in infos[name]
            ],
        }
    return measured, rounds


def processes(actors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per process (a host's stages joined: "0.0+2.0"), its RSS and weights."""
    by_pid: dict[int, dict[str, Any]] = {}
    for actor in actors:
        entry = by_pid.setdefault(actor["pid"], {**actor, "stages": [], "weights": 0})
        entry["stages"].append(actor["stage"])
        # A host reports its process's weights (its guests' beside its own), a guest its own.
        entry["weights"] = max(entry["weights"], actor["process_weights"])
        entry["part"] = entry.get("part", False) or "." in actor["stage"]
    return list(by_pid.values())


def _parts_above(layout: dict[str, Any]) -> int:
    return sum(p["rss"] - p["tf_mark"] for p in layout["processes"] if p["part"])


def _parts_weights(layout: dict[str, Any]) -> int:
    return sum(p["weights"] for p in layout["processes"] if p["part"])


def render(results: dict[str, Any]) -> str:
    lines = [
        f"a tied table of {results['table_bytes'] / MiB:.0f} MiB (lookup and logits); split "
        f"budget {results['budget'] / MiB:.0f} MiB; held twice and held once, side by side",
        "",
        "| layout | stages | processes | rows/s | p50 ms | p99 ms | batch alone p50 ms | "
        "parts' weights MiB | parts' RSS above TF MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, found in results["layouts"].items():
        lines.append(
            f"| {name} | {', '.join(found['stages'])} | {len(found['processes'])} | "
            f"{found['rows_per_s']:.0f} | {found['p50_ms']:.1f} | {found['p99_ms']:.1f} | "
            f"{found['alone_p50_ms']:.2f} | {_parts_weights(found) / MiB:.1f} | "
            f"{_parts_above(found) / MiB:.0f} |"
        )
    r = results["once_over_twice"]
    lines += [
        "",
        f"held once / held twice: rows/s {r['rows_per_s']:.2f}x (goal >= 0.9x; rounds "
        f"{', '.join(f'{x:.2f}' for x in r.get('rounds', []))}), p50 "
        f"{r['p50']:.2f}x, p99 {r['p99']:.2f}x, batch alone p50 {r['alone_p50']:.2f}x; the "
        f"parts' weights {r['parts_weights']:.2f}x, their RSS above TensorFlow "
        f"{r['parts_above_tf']:.2f}x",
        "",
        "| layout | process (stages) | weights MiB | RSS MiB | RSS above its TF import MiB |",
        "|---|---|---|---|---|",
    ]
    for name, found in results["layouts"].items():
        for proc in found["processes"]:
            above = proc["rss"] - proc["tf_mark"]
            lines.append(
                f"| {name} | {'+'.join(proc['stages'])} | {proc['weights'] / MiB:.1f} | "
                f"{proc['rss'] / MiB:.0f} | {above / MiB:.0f} |"
            )
    return "\n".join(lines) + "\n"
