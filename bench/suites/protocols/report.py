"""The protocols bench's results as Markdown: medians over rounds, ratios, issue 11's targets."""

from __future__ import annotations

import math
import statistics
from typing import Any

CEILING_TARGET = 0.75  # heavy, V2 binary req/s over the model's own rows/s at batch 64
CPU_TARGET = 1 / 3  # heavy, V2 binary front-end CPU per request over TF-Serving JSON's
LIGHT_TARGET = 1.3  # light, V2 binary req/s over TF-Serving JSON's
LABELS = {
    "tfserving": "TF-Serving JSON `/predict`",
    "v2-json": "V2 JSON",
    "v2-binary": "V2 binary tensors",
    "grpc": "V2 gRPC (raw contents)",
    "grpc-raw": "V2 gRPC, pre-serialized",
    "tfserving-grpc": "TF Serving gRPC `Predict`, pre-serialized",
}
_FIGURES: tuple[str, ...] = ("rps", "p50_ms", "p99_ms", "errors", "cpu_ms_per_request")
_FIGURES += ("frontend_cores", "loadgen_cores", "concurrency", "mean_batch_rows")
# Where the time goes (issue 32): CPU per unit of work and the machine's idle share.
_WORK = ("frontend_ms_per_request", "workers_ms_per_row", "ray_ms_per_request", "idle_share")

_PARTS = ("frontend", "shard_actors", "ray_other", "load_generator", "others")
Medians = dict[tuple[str, str], dict[str, float]]


def medians(runs: list[dict[str, Any]]) -> Medians:
    """(workload, protocol) -> the median of each figure over the rounds, and their count;
    ``cores.<part>`` for the CPU split."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["workload"], run["protocol"]), []).append(run)
    out: Medians = {}
    for group, rows in groups.items():
        figures = {k: statistics.median(r[k] for r in rows) for k in _FIGURES}
        for k in _WORK:  # absent from results written before issue 32
            values = [r[k] for r in rows if r.get(k) is not None]
            figures[k] = statistics.median(values) if values else math.nan
        for part in _PARTS:
            figures[f"cores.{part}"] = statistics.median(
                r.get("cores", {}).get(part, 0.0) for r in rows
            )
        out[group] = figures | {"n": len(rows)}
    return out


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0 or math.isnan(num) or math.isnan(den):
        return None
    return num / den


def render(results: dict[str, Any]) -> str:
    med = medians(results["runs"])
    lines = []
    for workload, ceiling in results["ceiling"].items():
        lines.append(
            f"- {workload} ceiling (direct calls at batch {ceiling['batch_size']}): "
            f"{ceiling['before_rows_per_s']:,.0f} rows/s before, "
            f"{ceiling['after_rows_per_s']:,.0f} after; ratios use the mean, "
            f"{ceiling['rows_per_s']:,.0f}"
        )
    lines += [
        "",
        "| workload | protocol | clients | req/s | p50 ms | p99 ms | errors | / ceiling "
        "| / TF-Serving JSON req/s | front-end CPU ms/req | / TF-Serving JSON CPU "
        "| front-end cores | load-gen cores | rows/batch |",
        "|" + "---|" * 14,
    ]
    for (workload, protocol), m in med.items():
        base = med.get((workload, "tfserving"), {})
        ceiling = results["ceiling"].get(workload, {}).get("rows_per_s")
        lines.append(
            f"| {workload} | {LABELS[protocol]} | {m['concurrency']:.0f} | {m['rps']:,.0f} "
            f"| {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | {m['errors']:.0f} "
            f"| {_x(ratio(m['rps'], ceiling))} | {_x(ratio(m['rps'], base.get('rps')))} "
            f"| {m['cpu_ms_per_request']:.3f} "
            f"| {_x(ratio(m['cpu_ms_per_request'], base.get('cpu_ms_per_request')))} "
            f"| {m['frontend_cores']:.2f} | {m['loadgen_cores']:.2f} | {m['mean_batch_rows']:.1f} |"
        )
    total = results.get("machine_cores") or 0
    lines += [
        "",
        f"Where the {total or '?'} cores went (mean cores busy per part over each window; *rest "
        "of machine* is everything else, other people's work included; idle = cores - the sum):",
        "",
        "| workload | protocol | front end | shard actor | rest of Ray | load generator "
        "| rest of machine | idle |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (workload, protocol), m in med.items():
        parts = [m[f"cores.{part}"] for part in _PARTS]
        idle = f"{max(total - sum(parts), 0.0):.2f}" if total else "-"
        lines.append(
            f"| {workload} | {LABELS[protocol]} | "
            + " | ".join(f"{v:.2f}" for v in parts)
            + f" | {idle} |"
        )
    lines += ["", *where_time_goes(results, med)]
    checks = targets(results, med)
    if checks:
        lines += ["", "| target (issue 11) | measured | verdict |", "|---|---|---|"]
        for target, measured, ok in checks:
            lines.append(f"| {target} | {measured} | {'met' if ok else '**missed**'} |")
    rounds = max((m["n"] for m in med.values()), default=0)
    quiet = results.get("quiet", {})
    settled = ""
    if not quiet.get("quiet", True):
        settled = " (not waited for)" if not quiet.get("wait_limit_s") else " (never settled)"
    lines += [
        "",
        f"Medians over {rounds:.0f} round(s) of {results['plan']['seconds']:g} s per protocol. "
        f"Before measuring: 1-min load {quiet.get('load_1min', float('nan')):.2f}, other "
        f"benchmarks: {', '.join(quiet.get('others') or []) or 'none'}; waited "
        f"{quiet.get('waited_s', 0):g} s{settled}.",
    ]
    noise = results["plan"].get("noise_cores")
    if noise is not None:
        again = sum(run.get("attempts", 1) - 1 for run in results["runs"])
        noisy = sum(run.get("cores", {}).get("others", 0.0) > noise for run in results["runs"])
        lines[-1] += (
            f" A window (or ceiling) in which the rest of the machine used more than {noise:g} "
            f"cores was measured again, up to {results['plan']['noise_retries']} times, keeping "
            f"the quietest: {again} re-measured, {noisy} kept above the limit."
        )
    return "\n".join(lines) + "\n"


def where_time_goes(results: dict[str, Any], med: Medians) -> list[str]:
    """Per workload and protocol: rows per batch, CPU per request of the front end and of the
    rest of Ray, the shard actor's CPU per row against the model's own at the max batch (the
    ceiling's, TensorFlow called directly), and the share of the machine idle."""
    lines = [
        "Where the time goes (CPU ms per request or per row; the model's own CPU per row at the "
        "max batch, TensorFlow called directly, beside the actor's):",
        "",
        "| workload | protocol | rows/batch | front end ms/req | shard actor ms/row "
        "| model alone ms/row | actor / model | rest of Ray ms/req | machine idle |",
        "|" + "---|" * 9,
    ]
    for (workload, protocol), m in med.items():
        raw = results["ceiling"].get(workload, {}).get("cpu_ms_per_row")
        lines.append(
            f"| {workload} | {LABELS[protocol]} | {m['mean_batch_rows']:.1f} "
            f"| {_ms(m['frontend_ms_per_request'])} | {_ms(m['workers_ms_per_row'])} "
            f"| {_ms(raw)} | {_x(ratio(m['workers_ms_per_row'], raw))} "
            f"| {_ms(m['ray_ms_per_request'])} | {_pct(m['idle_share'])} |"
        )
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def _pct(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:.0f}%"


def targets(results: dict[str, Any], med: Medians) -> list[tuple[str, str, bool]]:
    checks = []
    heavy_binary, heavy_json = med.get(("heavy", "v2-binary")), med.get(("heavy", "tfserving"))
    ceiling = results["ceiling"].get("heavy", {}).get("rows_per_s")
    if heavy_binary and ceiling:
        got = heavy_binary["rps"] / ceiling
        checks.append(
            (
                f"heavy, V2 binary >= {CEILING_TARGET}x the ceiling",
                f"{got:.2f}x ({heavy_binary['rps']:,.0f} of {ceiling:,.0f})",
                got >= CEILING_TARGET,
            )
        )
    if heavy_binary and heavy_json:
        cpu = ratio(heavy_binary["cpu_ms_per_request"], heavy_json["cpu_ms_per_request"])
        checks.append(
            (
                "heavy, V2 binary front-end CPU per request <= 1/3 of TF-Serving JSON's",
                f"{_x(cpu)} ({heavy_binary['cpu_ms_per_request']:.3f} vs "
                f"{heavy_json['cpu_ms_per_request']:.3f} ms)",
                cpu is not None and cpu <= CPU_TARGET,
            )
        )
    light_binary, light_json = med.get(("light", "v2-binary")), med.get(("light", "tfserving"))
    if light_binary and light_json:
        got = light_binary["rps"] / light_json["rps"]
        checks.append(
            (
                f"light c{light_binary['concurrency']:.0f}, V2 binary >= {LIGHT_TARGET}x "
                "TF-Serving JSON req/s",
                f"{got:.2f}x ({light_binary['rps']:,.0f} vs {light_json['rps']:,.0f})",
                got >= LIGHT_TARGET,
            )
        )
    return checks


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
