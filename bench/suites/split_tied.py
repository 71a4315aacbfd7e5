"""``python -m bench split --model tied``: a tied table (keras_hub's ``ReversibleEmbedding``, the
lookup at the start and the logits at the end, as GPT-2's) too large for one device, split by
rows and served held twice (a set of part actors for the lookups, another for the logits) and
held once (one set: part k's actor runs its lookup and, in a Ray concurrency group of its own,
its logits, from one copy of its rows; issue 42), side by side in one run, with the same model
in one stage as the reference.

The model: ids ``[batch, 1]`` -> a ``--rows`` x ``--dim`` float32 table -> two ``Dense`` of
``--dim`` (gelu, then linear) -> the table's logits ``[batch, 1, rows]``, which the driver
joins from the parts. The budget is ``--budget-share`` of the table; the plan sizes each part
for its rows and its activations (held once: both uses' beside one share of the rows). Each
bundle is served by one pipeline under ``--concurrency`` closed-loop callers for ``--seconds``
after ``--warmup``: rows/s (the pipeline's overlap: held once, batch n+1's lookup runs while
batch n's logits do, in the same process), p50/p99 of a batch, a batch alone; per process its
RSS above its TensorFlow import and its weights (a process running two stages counted once).
The figures to read: held once / held twice, rows/s (goal >= 0.9x) and the parts' RSS.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.suites.split import MiB, SplitPlan, _measure, _partition
from bench.systems.actors import local_ray


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
    ("one stage", None, "once"),
    ("split, held twice", True, "twice"),
    ("split, held once", True, "once"),
)


def run(plan: SplitPlan, progress: Any = print) -> dict[str, Any]:
    plan.workdir.mkdir(parents=True, exist_ok=True)
    table = plan.rows * plan.dim * 4
    budget = int(table * plan.budget_share)
    results: dict[str, Any] = {"model": "tied", "table_bytes": table, "budget": budget}
    found: dict[str, Any] = {}
    with local_ray(8), tempfile.TemporaryDirectory(dir=plan.workdir) as tmp:
        for name, split, tied in LAYOUTS:
            bundle = Path(tmp) / name.replace(" ", "_").replace(",", "")
            tick = time.monotonic()
            _partition(plan, bundle, budget if split else None, "dense", tied)
            progress(f"{name}: partitioned in {time.monotonic() - tick:.0f} s")
            found[name] = layout = asyncio.run(_measure(bundle, plan))
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
        "p50": once["p50_ms"] / twice["p50_ms"],
        "p99": once["p99_ms"] / twice["p99_ms"],
        "alone_p50": once["alone_p50_ms"] / twice["alone_p50_ms"],
        "parts_above_tf": _parts_above(once) / _parts_above(twice),
        "parts_weights": _parts_weights(once) / _parts_weights(twice),
    }
    return results


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
        f"held once / held twice: rows/s {r['rows_per_s']:.2f}x (goal >= 0.9x), p50 "
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
