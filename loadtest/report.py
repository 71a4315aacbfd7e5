"""The tuner's outputs: results.csv, report.md, latency_throughput.png and recommended.toml."""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Sequence
from pathlib import Path

from loadtest.choice import AUTO, Point, choose, compare_auto, medians, recommend

__all__ = ["write_all", "write_csv", "write_markdown", "write_plot", "write_toml"]

_FIELDS = [f.name for f in dataclasses.fields(Point)]


def write_csv(points: Sequence[Point], path: Path) -> None:
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=_FIELDS)
        writer.writeheader()
        for p in points:
            writer.writerow(dataclasses.asdict(p))


def _fmt(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def write_markdown(
    points: Sequence[Point], slo_p99_ms: float | None, path: Path, *, header: str = ""
) -> None:
    slo = f"p99 <= {slo_p99_ms:g} ms" if slo_p99_ms is not None else "no SLO (fastest wins)"
    lines = ["# Batching timeout sweep", ""]
    if header:
        lines += [header, ""]
    lines += [f"SLO: {slo}. Throughput counts successful requests only.", ""]
    for choice in choose(points, slo_p99_ms):
        lines += [f"## Load {choice.load}", ""]
        lines += [
            "| setting | req/s | p50 ms | p95 ms | p99 ms | failures | mean batch | |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for p in (q for q in points if q.load == choice.load):
            runs = f" (median of {p.runs})" if p.runs > 1 else ""
            mark = ""
            if p is choice.winner:
                mark = "**winner**" if choice.meets_slo else "**lowest p99 (misses SLO)**"
            lines.append(
                f"| {p.label}{runs} | {p.rps:.1f} | {p.p50_ms:.0f} | {p.p95_ms:.0f} "
                f"| {p.p99_ms:.0f} | {p.failures}/{p.requests} | {_fmt(p.mean_batch)} | {mark} |"
            )
        lines += ["", f"Winner: **{choice.winner.label}** ({choice.note}).", ""]
    checks = compare_auto(points, slo_p99_ms)
    if checks:
        lines += ["## auto against the best fixed timeout", ""]
        lines += [
            "| load | best fixed | auto req/s vs fixed | auto p99 vs fixed | within 10% |",
            "|---|---|---:|---:|---|",
        ]
        for c in checks:
            lines.append(
                f"| {c.load} | {c.best_fixed.label} | {c.rps_ratio:.0%} | {c.p99_ratio:.0%} "
                f"| {'yes' if c.ok else 'no'} |"
            )
        lines.append("")
    setting, why = recommend(points, slo_p99_ms)
    lines += ["## Recommended", "", f"`batch_timeout_ms = {_toml_timeout(setting[0])}`: {why}."]
    path.write_text("\n".join(lines) + "\n")


def write_plot(points: Sequence[Point], path: Path) -> None:
    """p99 against throughput, one curve per setting, points in load order."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    settings = list(dict.fromkeys(p.setting for p in points))
    for setting in settings:
        curve = [p for p in points if p.setting == setting]
        style = "-o" if setting[0] != AUTO else "-s"
        ax.plot([p.rps for p in curve], [p.p99_ms for p in curve], style, label=curve[0].label)
        for p in curve:
            ax.annotate(p.load, (p.rps, p.p99_ms), fontsize=7, alpha=0.6)
    ax.set_xlabel("throughput (successful requests/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_title("p99 against throughput per batching timeout (labels: load)")
    ax.grid(alpha=0.3)
    ax.legend(title="batch_timeout_ms", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _toml_timeout(timeout: str) -> str:
    return '"auto"' if timeout == AUTO else f"{float(timeout):g}"


def write_toml(points: Sequence[Point], slo_p99_ms: float | None, path: Path) -> None:
    """Settings to start the server with: ``shardserve serve --config recommended.toml``."""
    (timeout, max_batch_size), why = recommend(points, slo_p99_ms)
    lines = ["# Written by `shardserve tune`.", f"# {why}."]
    for choice in choose(points, slo_p99_ms):
        lines.append(f"# load {choice.load}: {choice.winner.label} ({choice.note})")
    lines += ["", "[shardserve]", f"batch_timeout_ms = {_toml_timeout(timeout)}"]
    if max_batch_size is not None:
        lines.append(f"max_batch_size = {max_batch_size}")
    if slo_p99_ms is not None:
        lines.append(f"slo_p99_ms = {slo_p99_ms:g}")
    path.write_text("\n".join(lines) + "\n")


def write_all(
    runs: Sequence[Point], slo_p99_ms: float | None, out: Path, *, header: str = ""
) -> list[Path]:
    """Every output file, or only the CSVs when nothing was measured yet.

    ``runs`` are single measurements; a setting measured more than once at a load level is
    reported as its medians (``results.csv``, the report, the plot, the recommendation), and
    ``runs.csv`` keeps every run.
    """
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "results.csv"
    points = medians(runs)
    write_csv(points, csv_path)
    write_csv(runs, out / "runs.csv")
    if not points:
        return [csv_path]
    paths = [out / "report.md", out / "latency_throughput.png", out / "recommended.toml"]
    write_markdown(points, slo_p99_ms, paths[0], header=header)
    write_plot(points, paths[1])
    write_toml(points, slo_p99_ms, paths[2])
    return [csv_path, *paths]
