"""The split bench's tables: per model the layouts' medians side by side, the ratios, each
round's rows/s with the machine's load, and each actor's memory against its plan."""

from __future__ import annotations

from typing import Any

from bench.suites.split.crossing import INLINE_MAX
from bench.suites.split.run import ONE, VERSUS

MiB = 2**20
KiB = 1024


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _head(model: str, found: dict[str, Any]) -> str:
    size, budget = found["layer_bytes"] / MiB, found["budget"] / MiB
    if model == "mlp":
        return (
            f"### MLP: fc1 -> fc2 of {size:.0f} MiB each, split budget {budget:.0f} MiB; paired "
            "(column then row: one place) and unpaired (each by columns: fc1's parts, a join, "
            "fc2's parts), against one stage"
        )
    return (
        f"### Tables: two of {size:.0f} MiB each, split budget {budget:.0f} MiB; the dense and "
        "the routed lookup combine, against one stage"
    )


def _model(model: str, found: dict[str, Any], batch: int) -> list[str]:
    lines = [
        _head(model, found),
        "",
        "| layout | stages | rows/s | p50 ms | p99 ms | batch alone p50 ms | store KiB/batch "
        "measured (objects) | store / inline KiB computed | KiB read / written (parts') | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, lay in found["layouts"].items():
        c = lay["crossing"]
        lines.append(
            f"| {name} | {', '.join(lay['stages'])} | {lay['rows_per_s']:.0f} | "
            f"{lay['p50_ms']:.1f} | {lay['p99_ms']:.1f} | {lay['alone_p50_ms']:.2f} | "
            f"{lay['store_bytes'] / KiB:.1f} ({lay['store_objects']:.1f}) | "
            f"{c['store'] / KiB:.1f} / {c['inline'] / KiB:.1f} | {c['read'] / KiB:.1f} / "
            f"{c['written'] / KiB:.1f} ({c['parts_written'] / KiB:.1f}) | "
            f"{lay['load'][0]:.1f}-{lay['load'][1]:.1f} |"
        )
    lines.append("")
    for name, over in found["over_one"].items():
        lines.append(
            f"- {name} / {ONE}: rows/s {_x(over['rows_per_s'])}, p50 {_x(over['p50_ms'])}, p99 "
            f"{_x(over['p99_ms'])}, a batch alone {_x(over['alone_p50_ms'])}"
        )
    this, that = VERSUS[model]
    v = found["versus"]
    lines += [
        f"- {this} / {that}: store bytes measured {_x(v['store_bytes'])} (computed "
        f"{_x(v['computed_store'])}), rows/s {_x(v['rows_per_s'])}, p50 {_x(v['p50_ms'])}, p99 "
        f"{_x(v['p99_ms'])}, a batch alone {_x(v['alone_p50_ms'])}",
        "",
        "| round | " + " | ".join(f"{name} rows/s (load)" for name in found["layouts"]) + " |",
        "|---|" + "---|" * len(found["layouts"]),
    ]
    for r, seen in enumerate(found["rounds"]):
        cells = [
            f"{seen[n]['rows_per_s']:.0f} ({seen[n]['load'][0]:.1f}-{seen[n]['load'][1]:.1f})"
            for n in found["layouts"]
        ]
        lines.append(f"| {r + 1} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| layout | stage | weights MiB | planned peak MiB | RSS MiB | of it the store's shared "
        "pages MiB | RSS above its TF import, less those, MiB | measured / plan | peak RSS above "
        "TF / plan |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, lay in found["layouts"].items():
        for a in lay["actors"]:
            above = a["rss"] - a["shm"] - a["tf_mark"]
            peak = a["rss_peak"] - a["tf_mark"]
            lines.append(
                f"| {name} | {a['stage']} | {a['weights'] / MiB:.1f} | {a['planned'] / MiB:.1f} "
                f"| {a['rss'] / MiB:.0f} | {a['shm'] / MiB:.0f} | {above / MiB:.0f} | "
                f"{_x(above / a['planned'])} | {_x(peak / a['planned'])} |"
            )
    return [*lines, ""]


def render(results: dict[str, Any]) -> str:
    if results.get("model") == "tied":
        from bench.suites.split import tied

        return tied.render(results)
    batch = results["batch"]
    lines = [
        f"Batches of {batch} rows; medians of {results['repeats']} rounds (the layouts' order "
        "reversed every other round, one layout served at a time); ratios are each round's, "
        "then their median. Store: bytes created in Ray's shared-memory object store per "
        f"loaded batch (measured: Ray's cumulative count); computed from the stage signatures "
        f"at {batch} rows, an object under {INLINE_MAX // KiB} KiB passing inline. Load: the "
        "1-min load average before and after the layout's run. Measured / plan: the actor's "
        "RSS above its process right after importing TensorFlow, less the object store's shared "
        "pages it maps (``RssShmem``: written or read batches, not its own), against the plan's "
        "peak; the peak (``VmHWM``, loading included) cannot be parted so.",
        "",
    ]
    for model, found in results["models"].items():
        lines += _model(model, found, batch)
    return "\n".join(lines)
