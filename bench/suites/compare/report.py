"""Results -> ``docs/benchmarks.md`` (medians, ratios, targets, machine, command) and PNG plots.

The hand-written analysis below the ``ANALYSIS_MARKER`` line of an existing report is kept, so
a re-run refreshes the numbers without losing the explanation of them.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.observe.machine import machine

ANALYSIS_MARKER = (
    "<!-- analysis: written by hand, kept when `python -m bench` rewrites the rest -->"
)
PEERS = ("litserve", "rayserve")
# Where the time goes, per window (issue 32): ``bench.suites.compare.run.where_time_goes``.
_WORK = (
    "mean_batch_rows",
    "frontend_ms_per_request",
    "workers_ms_per_row",
    "ray_ms_per_request",
    "idle_share",
)


def medians(runs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, float]]:
    """(workload, system, scenario) -> median of each number over the repeats."""
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        grouped[(run["workload"], run["system"], run["scenario"])].append(run)
    out = {}
    for key, group in grouped.items():
        out[key] = {
            name: statistics.median(float(r[name]) for r in group)
            for name in ("rps", "p50_ms", "p99_ms", "errors")
        }
        for name in _WORK:  # absent from results written before issue 32
            values = [float(r[name]) for r in group if r.get(name) is not None]
            out[key][name] = statistics.median(values) if values else float("nan")
        out[key]["rss_mb"] = statistics.median(r["frontend"]["rss_mb"] for r in group)
        out[key]["tf"] = float(any(r["frontend"]["tensorflow_loaded"] for r in group))
        out[key]["n"] = len(group)
    return out


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _workload_section(
    workload: str, med: dict[tuple[str, str, str], dict[str, float]], ceiling: dict[str, Any]
) -> list[str]:
    systems = sorted({s for (w, s, _) in med if w == workload}, key=_system_order)
    scenarios = sorted({c for (w, _, c) in med if w == workload}, key=_scenario_order)
    lines = [f"### {workload}", ""]
    if ceiling:
        parts = [
            f"batch {b}: {v['rows_per_s']:,.0f} rows/s ({v['ms']:.1f} ms)"
            for b, v in ceiling.items()
        ]
        lines += ["Ceiling (the model called directly, no serving): " + "; ".join(parts) + ".", ""]
    header = ["system"]
    for sc in scenarios:
        header += [f"{sc} req/s", f"{sc} p50 ms", f"{sc} p99 ms"]
    header += ["front-end RSS MB", "TF in front end"]
    rows = []
    for system in systems:
        row = [system]
        for sc in scenarios:
            m = med.get((workload, system, sc))
            row += (
                [f"{m['rps']:,.0f}", f"{m['p50_ms']:.1f}", f"{m['p99_ms']:.1f}"] if m else ["-"] * 3
            )
        any_m = next(
            med[(workload, system, sc)] for sc in scenarios if (workload, system, sc) in med
        )
        row += [f"{any_m['rss_mb']:.0f}", "yes" if any_m["tf"] else "no"]
        rows.append(row)
    lines += [*_table(header, rows), ""]
    lines += _ratio_lines(workload, systems, scenarios, med, ceiling)
    lines += _time_lines(workload, systems, scenarios, med, ceiling)
    return lines


def _time_lines(
    workload: str,
    systems: list[str],
    scenarios: list[str],
    med: dict[tuple[str, str, str], dict[str, float]],
    ceiling: dict[str, Any],
) -> list[str]:
    """Where the time goes: rows per batch, CPU per request of the front end and the rest of
    Ray, the model workers' CPU per row (per request where a server counts no rows) against the
    model's own at the max batch, and the machine's idle share."""
    largest = max(ceiling, key=int) if ceiling else None
    raw = ceiling[largest].get("cpu_ms_per_row") if largest else None
    header = ["system", "scenario", "rows/batch", "front end ms/req", "workers ms/row"]
    header += [f"model alone ms/row (batch {largest})", "rest of Ray ms/req", "machine idle"]
    rows = []
    for system in systems:
        for sc in scenarios:
            m = med.get((workload, system, sc))
            if m is None:
                continue
            idle = m["idle_share"]
            rows.append(
                [
                    system,
                    sc,
                    _num(m["mean_batch_rows"], 1),
                    _num(m["frontend_ms_per_request"]),
                    _num(m["workers_ms_per_row"]),
                    _num(raw),
                    _num(m["ray_ms_per_request"]),
                    "-" if idle != idle else f"{100 * idle:.0f}%",
                ]
            )
    title = "Where the time goes (CPU per request or row, medians):"
    return [title, "", *_table(header, rows), ""]


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def _ratio_lines(
    workload: str,
    systems: list[str],
    scenarios: list[str],
    med: dict[tuple[str, str, str], dict[str, float]],
    ceiling: dict[str, Any],
) -> list[str]:
    best_ceiling = max((v["rows_per_s"] for v in ceiling.values()), default=None)
    ours = [s for s in systems if s.startswith("shardserve")]
    peers = [s for s in systems if s in PEERS]
    busiest = max((sc for sc in scenarios if sc.startswith("c")), key=_scenario_order, default=None)
    if busiest is None:
        return []
    header = ["shardserve", *[f"/ {p} ({busiest} req/s)" for p in peers], "/ ceiling rows/s"]
    rows = []
    for system in ours:
        mine = med.get((workload, system, busiest), {}).get("rps")
        row = [system]
        row += [_ratio(mine, med.get((workload, p, busiest), {}).get("rps")) for p in peers]
        row.append(_ratio(mine, best_ceiling))
        rows.append(row)
    return [f"Ratios at {busiest} (medians):", "", *_table(header, rows), ""]


def _overlap_section(overlap: list[dict[str, Any]]) -> list[str]:
    if not overlap:
        return []
    by_k: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for rec in overlap:
        by_k[rec["stages"]].append(rec)
    first = overlap[0]
    lines = [
        "## Pipeline overlap",
        "",
        f"Each shard actor sleeps {first['device_ms']:g} ms per batch instead of computing "
        f"(`--simulate-device-ms {first['device_ms']:g}`), max batch {first['batch_size']}; "
        f"ideal = 1/T = {first['ideal_batches_per_s']:.1f} batches/s whatever K.",
        "",
    ]
    rows = []
    for k in sorted(by_k):
        recs = by_k[k]
        rows.append(
            [
                str(k),
                f"{statistics.median(r['batches_per_s'] for r in recs):.2f}",
                f"{statistics.median(r['mean_batch_rows'] for r in recs):.1f}",
                f"{statistics.median(r['efficiency'] for r in recs):.3f}",
                f"{1 / k:.3f}",
            ]
        )
    header = ["K stages", "batches/s", "rows/batch", "overlap efficiency", "without overlap"]
    return [*lines, *_table(header, rows), ""]


def render(results: dict[str, Any], command: str, old_report: str = "") -> str:
    med = medians(results["runs"])
    plan = results["plan"]
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m bench`; numbers are medians over "
        f"{plan['repeats']} rounds of {plan['seconds']:g} s per scenario.",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine()}",
        f"- Max batch {plan['max_batch_size']}, batch timeout {plan['batch_timeout_ms']:g} ms for "
        "every system; `cN` = closed loop with N clients (wrk), `openR` = open loop at R req/s.",
        "- The load generator runs on the same cores as the server: every system pays that tax.",
        "",
        "![throughput](bench_throughput.png)",
        "![p99](bench_p99.png)",
        "",
        "## Results",
        "",
    ]
    for workload in plan["workloads"]:
        lines += _workload_section(workload, med, results["ceiling"].get(workload, {}))
    lines += _overlap_section(results.get("overlap", []))
    failures = results.get("failures", [])
    if failures:
        lines += ["## Rounds that failed (left out of the medians)", ""]
        lines += [
            f"- {f['workload']} {f['system']} round {f['repeat'] + 1}: {f['error'][:300]}"
            for f in failures
        ]
        lines.append("")
    analysis = old_report.split(ANALYSIS_MARKER, 1)[1] if ANALYSIS_MARKER in old_report else "\n"
    return "\n".join(lines) + "\n" + ANALYSIS_MARKER + analysis


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = medians(results["runs"])
    workloads = list(results["plan"]["workloads"])
    systems = sorted({s for (_, s, _) in med}, key=_system_order)
    busiest = max({sc for (_, _, sc) in med if sc.startswith("c")}, key=_scenario_order)
    paths = []
    for metric, label, name in (("rps", "requests/s", "throughput"), ("p99_ms", "p99 ms", "p99")):
        fig, axes = plt.subplots(
            1, len(workloads), figsize=(5 * len(workloads), 3.5), squeeze=False
        )
        for ax, workload in zip(axes[0], workloads, strict=True):
            values = [med.get((workload, s, busiest), {}).get(metric, 0.0) for s in systems]
            ax.bar(
                systems,
                values,
                color=["#2a7" if s.startswith("shard") else "#888" for s in systems],
            )
            ax.set_title(f"{workload}, {busiest}")
            ax.set_ylabel(label)
            ax.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        path = out_dir / f"bench_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _system_order(name: str) -> tuple[int, str]:
    return (0 if name.startswith("shardserve") else 1, name)


def _scenario_order(name: str) -> tuple[int, float]:
    if name.startswith("c"):
        return (0, float(name[1:]))
    return (1, float(name.removeprefix("open") or 0))
