"""``python -m bench split``: a model whose embedding tables are split across devices (issue 29)
against the same model in one stage.

The model: a recommender of two tables of ``--rows`` x ``--dim`` float32 each (128 MiB at the
default 1 048 576 x 32; the item table read for a history of 20 ids and for the candidate, with
``mask_zero``), an MLP and a score (``--model mlp`` instead: ``--width`` -> fc1 of ``--hidden``
units, relu -> fc2 of ``--width`` -> a score, the budget a share of fc1, so that fc1 and fc2
split as a pair, Megatron's column- then row-parallel layers, against one stage; ``--model
tied``: a tied table's lookup and logits, split and held twice against held once, in
``bench.suites.split_tied``). It is
partitioned in a child (this process never loads TensorFlow) with no budget (one stage: it fits
this machine's RAM) and under a budget of ``--budget-share`` of one table (or of fc1), which
splits each table by rows into parts of their own (``--device-overhead-bytes 0``): for the
tables twice, with the dense and with the routed lookup combine (below). Each bundle is served by one pipeline (``ReplicaSet``, no HTTP) on
a private local Ray, under ``--concurrency`` closed-loop callers of ``--batch`` rows each, for
``--seconds`` after ``--warmup``. Per layout it prints:

- rows/s and the p50 and p99 of a batch's latency under that load;
- the p50 of a batch alone (one caller), and the split's excess over the one stage: the per-batch
  cost of the fan-out (the batch's tensors sent to every part) and the combine (the next stage
  adding the parts' outputs);
- per actor: its stage label, planned peak and measured RSS (and above its RSS once TensorFlow
  was imported: the plan counts no overhead here);
- the bytes a batch moves between the processes (``crossing``): every stage's inputs read and
  outputs written, computed from the bundle's stage signatures at ``--batch`` rows (inputs sent
  to every part count once per part; Ray keeps objects under 100 KiB inline, beside the call,
  and larger ones in the shared-memory object store).

The split layout is measured twice, side by side in one run: with the dense lookup combine
(each part writes the whole output, zeros outside its rows, then one exact add) and with the
routed one (``lookup_combine="routed"``: each part writes only its rows' vectors and their
positions, the combine scatters them; issue 42). A routed part's outputs lead with the rows it
found, not the batch's: their bytes are counted at the ids' share that falls in its range
(uniform ids: ids / parts per part; over the parts of one call, exactly the ids read). On 2
cores no speed-up is expected: the figure is the overhead, and the memory per part against the
plan.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import options
from bench.systems.actors import cpu_only_env, local_ray

MiB = 2**20
HISTORY = 20


@dataclass(frozen=True)
class SplitPlan:
    rows: int = 1_048_576  # per table: 128 MiB at dim 32
    dim: int = 32
    budget_share: float = 0.6  # the split budget, as a share of one table's bytes
    batch: int = 32
    concurrency: int = 4
    seconds: float = 20.0
    warmup_s: float = 3.0
    workdir: Path = Path(".bench/split")
    model: str = "tables"  # or "mlp": fc1 -> fc2, split as a pair; "tied": a tied table
    width: int = 512  # the MLP's input and output units
    hidden: int = 8192  # its hidden units (fc1's output, fc2's input)

    def __post_init__(self) -> None:
        if self.rows < 16 or self.dim < 1:
            raise ValueError(f"--rows must be >= 16 and --dim >= 1, got {self.rows}, {self.dim}")
        if not 0.05 <= self.budget_share < 1.0:
            raise ValueError(f"--budget-share must be in [0.05, 1), got {self.budget_share}")
        if self.model not in ("tables", "mlp", "tied"):
            raise ValueError(f"--model is 'tables', 'mlp' or 'tied', got {self.model!r}")


def build(rows: int, dim: int) -> Any:
    """Two tables of ``rows`` x ``dim``, an MLP, a score (built in code, seeded)."""
    import keras

    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=1)
    history = keras.Input((HISTORY,), dtype="int32", name="history")
    item = keras.Input((1,), dtype="int32", name="item")
    user = keras.Input((1,), dtype="int32", name="user")
    items = keras.layers.Embedding(
        rows, dim, mask_zero=True, embeddings_initializer=init, name="items"
    )
    users = keras.layers.Embedding(rows, dim, embeddings_initializer=init, name="users")
    x = keras.layers.Concatenate(name="features")(
        [
            keras.layers.GlobalAveragePooling1D(name="pool")(items(history)),
            keras.layers.Flatten(name="candidate")(items(item)),
            keras.layers.Flatten(name="user_vector")(users(user)),
        ]
    )
    x = keras.layers.Dense(128, activation="relu", kernel_initializer=init, name="mlp")(x)
    score = keras.layers.Dense(1, kernel_initializer=init, name="score")(x)
    return keras.Model([history, item, user], score, name="split_rec")


def build_mlp(width: int, hidden: int) -> Any:
    """x -> fc1 (relu) -> fc2 -> a score: fc1 and fc2 both too large for the split budget, an
    elementwise activation between them, so the planner pairs them (built in code, seeded)."""
    import keras

    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=2)
    x = keras.Input((width,), name="x")
    h = keras.layers.Dense(hidden, activation="relu", kernel_initializer=init, name="fc1")(x)
    y = keras.layers.Dense(width, kernel_initializer=init, name="fc2")(h)
    score = keras.layers.Dense(1, kernel_initializer=init, name="score")(y)
    return keras.Model(x, score, name="split_mlp")


def _builder(plan: SplitPlan) -> str:
    if plan.model == "mlp":
        return f"build_mlp({plan.width}, {plan.hidden})"
    if plan.model == "tied":
        return f"build_tied({plan.rows}, {plan.dim})"
    return f"build({plan.rows}, {plan.dim})"


def _imports(plan: SplitPlan) -> tuple[str, ...]:
    """The modules a bundle's stage files need (keras_hub's ReversibleEmbedding)."""
    return ("keras_hub",) if plan.model == "tied" else ()


def _layer_bytes(plan: SplitPlan) -> int:
    """The bytes of the layer the budget is a share of: one table, or fc1."""
    if plan.model == "mlp":
        return plan.width * plan.hidden * 4
    return plan.rows * plan.dim * 4


def _partition(
    plan: SplitPlan, out: Path, budget: int | None, combine: str = "dense", tied: str = "once"
) -> None:
    how = "stages=1" if budget is None else f"max_stage_bytes={budget}"
    how += f", lookup_combine={combine!r}, tied_tables={tied!r}, imports={list(_imports(plan))!r}"
    code = (
        "from bench.suites.split import build, build_mlp; "
        "from bench.suites.split_tied import build as build_tied; "
        "from shards.partition.cut import "
        f"partition_to_bundle; partition_to_bundle({_builder(plan)}, "
        f"{str(out)!r}, {how}, plan_batch_rows={plan.batch}, device_overhead_bytes=0, "
        "source_name='split_rec')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=cpu_only_env())


def _inputs(plan: SplitPlan, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if plan.model == "mlp":
        return {"x": rng.normal(size=(plan.batch, plan.width)).astype("float32")}
    if plan.model == "tied":
        return {"ids": rng.integers(0, plan.rows, size=(plan.batch, 1)).astype("int32")}
    history = rng.integers(1, plan.rows, size=(plan.batch, HISTORY)).astype("int32")
    history[:, HISTORY // 2 :] *= rng.integers(0, 2, size=(plan.batch, 1)).astype("int32")
    return {
        "history": history,
        "item": rng.integers(1, plan.rows, size=(plan.batch, 1)).astype("int32"),
        "user": rng.integers(0, plan.rows, size=(plan.batch, 1)).astype("int32"),
    }


async def _load(group: Any, plan: SplitPlan, callers: int, seconds: float) -> list[float]:
    """Each caller's batch latencies (s) for ``seconds`` of closed-loop load."""
    batches = [_inputs(plan, seed) for seed in range(8)]
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


async def _measure(bundle: Path, plan: SplitPlan) -> dict[str, Any]:
    from shards.bundle.format import read_manifest
    from shards.pipeline.options import PipelineOptions
    from shards.pipeline.replica_set import ReplicaSet

    manifest = read_manifest(bundle)
    planned = {s.name: s.planned_peak_bytes for s in manifest.stages}
    crossing = _crossing(manifest.stages, plan.batch)
    options = PipelineOptions(replicas=1, batch_sizes=(plan.batch,), imports=_imports(plan))
    group = await ReplicaSet.create(bundle, options)
    try:
        await _load(group, plan, plan.concurrency, plan.warmup_s)
        loaded = await _load(group, plan, plan.concurrency, plan.seconds)
        alone = await _load(group, plan, 1, max(1.0, plan.seconds / 4))
        actors = [
            {
                "stage": info["stage"],
                "planned": planned[info["stage"]],
                "rss": info["memory"]["rss_bytes"],
                "tf_mark": info["memory"]["rss_marks"]["tensorflow"],
                "weights": info["weight_bytes"],
                # One process may run two stages (a tied table held once): counted once.
                "pid": info["pid"],
                "process_weights": info["memory"]["weight_bytes"],
            }
            for info in await group.describe()
        ]
    finally:
        await group.close()
    ordered = sorted(loaded)
    return {
        "stages": [s.name for s in manifest.stages],
        "rows_per_s": len(loaded) * plan.batch / plan.seconds,
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "alone_p50_ms": 1000 * statistics.median(alone),
        "actors": actors,
        "crossing": crossing,
    }


def _batch_bytes(specs: Any, batch: int) -> int:
    total = 0
    for t in specs:
        row = int(np.prod([1 if d is None else d for d in t.shape], dtype=np.int64))
        total += batch * row * np.dtype(t.dtype).itemsize
    return total


def _routed(stage: Any) -> bool:
    """A routed row part: per id tensor read, its vectors and their positions (``[]``, int32)."""
    outs = stage.outputs
    return (
        stage.part is not None
        and stage.part.how == "rows"
        and len(outs) == 2 * len(stage.inputs)
        and all(tuple(t.shape) == () and t.dtype == "int32" for t in outs[1::2])
    )


def _written(stage: Any, batch: int) -> dict[str, int]:
    """Each output's bytes for one batch: a routed part's at its share of the ids it read."""
    if not _routed(stage):
        return {t.name: _batch_bytes([t], batch) for t in stage.outputs}
    share = 1 / stage.part.parts  # uniform ids: this share of them falls in its range
    sizes: dict[str, int] = {}
    for ids, vectors, positions in zip(
        stage.inputs, stage.outputs[0::2], stage.outputs[1::2], strict=True
    ):
        found = batch * int(np.prod([1 if d is None else d for d in ids.shape])) * share
        sizes[vectors.name] = int(found * _batch_bytes([vectors], 1))
        sizes[positions.name] = int(found * 4)
    return sizes


def _crossing(stages: Any, batch: int) -> dict[str, int]:
    """Bytes one batch of ``batch`` rows reads and writes across processes, and the part
    stages' share of the writes (dense: every part writes the whole output; routed: its rows)."""
    written = {s.name: _written(s, batch) for s in stages}
    made = {name: size for sizes in written.values() for name, size in sizes.items()}
    return {
        "read": sum(made.get(t.name, _batch_bytes([t], batch)) for s in stages for t in s.inputs),
        "written": sum(sum(sizes.values()) for sizes in written.values()),
        "parts_written": sum(sum(written[s.name].values()) for s in stages if s.part),
    }


def run(plan: SplitPlan, progress: Any = print) -> dict[str, Any]:
    if plan.model == "tied":
        from bench.suites import split_tied

        return split_tied.run(plan, progress)
    plan.workdir.mkdir(parents=True, exist_ok=True)
    layer_bytes = _layer_bytes(plan)
    budget = int(layer_bytes * plan.budget_share)
    results: dict[str, Any] = {
        "model": plan.model,
        "table_bytes": layer_bytes,
        "budget": budget,
        "layouts": {},
    }
    with local_ray(8), tempfile.TemporaryDirectory(dir=plan.workdir) as tmp:
        layouts: tuple[tuple[str, int | None, str], ...] = (
            ("one stage", None, "dense"),
            ("split, dense combine", budget, "dense"),
            ("split, routed combine", budget, "routed"),
        )
        if plan.model == "mlp":
            layouts = (("one stage", None, "dense"), ("split, paired", budget, "dense"))
        for name, given, combine in layouts:
            bundle = Path(tmp) / name.replace(" ", "_").replace(",", "")
            tick = time.monotonic()
            _partition(plan, bundle, given, combine)
            progress(f"{name}: partitioned in {time.monotonic() - tick:.0f} s")
            results["layouts"][name] = found = asyncio.run(_measure(bundle, plan))
            progress(
                f"{name}: stages {', '.join(found['stages'])}; {found['rows_per_s']:.0f} rows/s, "
                f"p99 {found['p99_ms']:.1f} ms, alone p50 {found['alone_p50_ms']:.2f} ms"
            )
    found = results["layouts"]
    whole = found["one stage"]
    if plan.model == "mlp":
        paired = found["split, paired"]
        results["fan_out_combine_ms"] = paired["alone_p50_ms"] - whole["alone_p50_ms"]
        results["split_over_one"] = {
            "rows_per_s": paired["rows_per_s"] / whole["rows_per_s"],
            "alone_p50": paired["alone_p50_ms"] / whole["alone_p50_ms"],
        }
        return results
    dense, routed = found["split, dense combine"], found["split, routed combine"]
    results["fan_out_combine_ms"] = dense["alone_p50_ms"] - whole["alone_p50_ms"]
    results["routed_fan_out_combine_ms"] = routed["alone_p50_ms"] - whole["alone_p50_ms"]
    results["routed_over_dense"] = {
        "parts_written": routed["crossing"]["parts_written"] / dense["crossing"]["parts_written"],
        "crossing": _moved(routed["crossing"]) / _moved(dense["crossing"]),
        "rows_per_s": routed["rows_per_s"] / dense["rows_per_s"],
        "alone_p50": routed["alone_p50_ms"] / dense["alone_p50_ms"],
        "p99": routed["p99_ms"] / dense["p99_ms"],
    }
    return results


def _moved(crossing: dict[str, int]) -> int:
    return crossing["read"] + crossing["written"]


def render(results: dict[str, Any]) -> str:
    if results.get("model") == "tied":
        from bench.suites import split_tied

        return split_tied.render(results)
    if results.get("model") == "mlp":
        head = (
            f"an MLP fc1 -> fc2 of {results['table_bytes'] / MiB:.0f} MiB each; split budget "
            f"{results['budget'] / MiB:.0f} MiB: fc1 and fc2 split as a pair, against one stage"
        )
    else:
        head = (
            f"two tables of {results['table_bytes'] / MiB:.0f} MiB each; split budget "
            f"{results['budget'] / MiB:.0f} MiB; the split with the dense and the routed lookup "
            "combine, side by side"
        )
    lines = [
        head,
        "",
        "| layout | stages | rows/s | p50 ms | p99 ms | batch alone p50 ms | KiB read / "
        "written per batch (parts' writes) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, found in results["layouts"].items():
        c = found.get("crossing", {"read": 0, "written": 0, "parts_written": 0})
        lines.append(
            f"| {name} | {', '.join(found['stages'])} | {found['rows_per_s']:.0f} | "
            f"{found['p50_ms']:.1f} | {found['p99_ms']:.1f} | {found['alone_p50_ms']:.2f} | "
            f"{c['read'] / 1024:.1f} / {c['written'] / 1024:.1f} "
            f"({c['parts_written'] / 1024:.1f}) |"
        )
    lines += [
        "",
        f"fan-out + combine, per batch alone: {results['fan_out_combine_ms']:+.2f} ms"
        + (
            f" (dense), routed {results['routed_fan_out_combine_ms']:+.2f} ms"
            if "routed_fan_out_combine_ms" in results
            else ""
        ),
    ]
    over = results.get("split_over_one")
    if over:
        lines.append(
            f"split / one stage: rows/s {over['rows_per_s']:.2f}x, batch alone p50 "
            f"{over['alone_p50']:.2f}x"
        )
    ratio = results.get("routed_over_dense")
    if ratio:
        lines.append(
            f"routed / dense: parts' writes {ratio['parts_written']:.2f}x, bytes read + written "
            f"{ratio['crossing']:.2f}x, rows/s {ratio['rows_per_s']:.2f}x, batch alone p50 "
            f"{ratio['alone_p50']:.2f}x, p99 {ratio['p99']:.2f}x"
        )
    lines += [
        "",
        "| layout | stage | weights MiB | planned peak MiB | RSS MiB | RSS above its TF import "
        "MiB | above / planned |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, found in results["layouts"].items():
        for actor in found["actors"]:
            above = actor["rss"] - actor["tf_mark"]
            lines.append(
                f"| {name} | {actor['stage']} | {actor['weights'] / MiB:.1f} | "
                f"{actor['planned'] / MiB:.1f} | {actor['rss'] / MiB:.0f} | {above / MiB:.0f} | "
                f"{above / actor['planned']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def add_parsers(sub: Any) -> None:
    about = (
        "split layers (tables; --model mlp: fc1 -> fc2 paired; --model tied: a tied table held "
        "twice vs once) vs one stage: req/s, p99, RSS"
    )
    opts = options.suite(
        sub, "split", about, out="docs/bench-split", plan=SplitPlan, run=run, render=render
    )
    opts.own("--rows", type=int, help="rows per table")
    opts.own("--dim", type=int)
    opts.own("--budget-share", type=float, help="the split budget, as a share of one table")
    opts.own("--batch", type=int)
    opts.own(
        "--model",
        choices=("tables", "mlp", "tied"),
        help="the tables (dense vs routed), the MLP, or a tied table (held twice vs once)",
    )
    opts.own("--width", type=int, help="the MLP's input and output units")
    opts.own("--hidden", type=int, help="the MLP's hidden units")
    opts.add("concurrency", "seconds", "warmup_s", "workdir")
