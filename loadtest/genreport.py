"""The generation tuner's outputs: results.csv, runs.csv, report.md, ttft_tokens.png and
recommended.toml (``loadtest.report``'s, for ``loadtest.genchoice``'s points)."""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Sequence
from pathlib import Path

from loadtest.genchoice import AUTO, GenPoint, Targets, choose, medians, recommend

__all__ = ["write_all"]

_FIELDS = [f.name for f in dataclasses.fields(GenPoint)]
PLOT = "ttft_tokens.png"


def write_csv(points: Sequence[GenPoint], path: Path) -> None:
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=_FIELDS)
        writer.writeheader()
        for p in points:
            writer.writerow(dataclasses.asdict(p))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def write_markdown(
    points: Sequence[GenPoint], targets: Targets, path: Path, *, header: str = ""
) -> None:
    lines = ["# Generation knobs sweep", ""]
    if header:
        lines += [header, ""]
    lines += [
        f"Targets: {targets.describe()}. Tokens/s counts the clean streams' output tokens; "
        "TPOT is the time per output token after the first, per stream.",
        "",
    ]
    for choice in choose(points, targets):
        lines += [f"## Load {choice.load}", ""]
        lines += [
            "| prefill_timeout_ms | max_running | prefill_budget | tokens/s | streams/s "
            "| TTFT p50/p95 ms | TPOT p50/p95 ms | failures | rows/step | |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for p in (q for q in points if q.load == choice.load):
            mark = ""
            if p is choice.winner:
                mark = "**winner**" if choice.meets else "**misses least**"
            elif p.meets(targets):
                mark = "meets"
            runs = f" (median of {p.runs})" if p.runs > 1 else ""
            budget = "none" if p.prefill_budget_tokens is None else p.prefill_budget_tokens
            rows = "-" if p.rows_per_step is None else f"{p.rows_per_step:.1f}"
            lines.append(
                f"| {p.prefill_timeout_ms}{runs} | {p.max_running_sequences} | {budget} "
                f"| {p.tokens_per_s:.1f} | {p.streams_per_s:.2f} "
                f"| {_ms(p.ttft_p50_ms)}/{_ms(p.ttft_p95_ms)} "
                f"| {_ms(p.tpot_p50_ms)}/{_ms(p.tpot_p95_ms)} | {p.failures}/{p.streams} "
                f"| {rows} | {mark} |"
            )
        lines += ["", f"Winner: **{choice.winner.label}** ({choice.note}).", ""]
    point, _, why = recommend(points, targets)
    lines += ["## Recommended", "", f"{_toml_line(point)}: {why}.", ""]
    path.write_text("\n".join(lines))


def _toml_lines(point: GenPoint) -> list[str]:
    wait = point.prefill_timeout_ms
    value = '"auto"' if wait == AUTO else f"{float(wait):g}"
    lines = [
        f"prefill_timeout_ms = {value}",
        f"max_running_sequences = {point.max_running_sequences}",
    ]
    if point.prefill_budget_tokens is None:
        lines.append("# prefill_budget_tokens unset: no cap")
    else:
        lines.append(f"prefill_budget_tokens = {point.prefill_budget_tokens}")
    return lines


def _toml_line(point: GenPoint) -> str:
    return "`" + "`, `".join(line for line in _toml_lines(point) if not line.startswith("#")) + "`"


def write_toml(points: Sequence[GenPoint], targets: Targets, path: Path) -> None:
    """Settings to start the server with: ``shardserve serve --config recommended.toml``."""
    point, _, why = recommend(points, targets)
    lines = ["# Written by `shardserve tune --generate`.", f"# {why}."]
    for choice in choose(points, targets):
        lines.append(f"# load {choice.load}: {choice.winner.label} ({choice.note})")
    lines += ["", "[shardserve]", *_toml_lines(point)]
    path.write_text("\n".join(lines) + "\n")


def write_plot(points: Sequence[GenPoint], targets: Targets, path: Path) -> None:
    """TTFT p95 and TPOT p95 against output tokens/s, one curve per setting over the loads."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    settings = list(dict.fromkeys(p.setting for p in points))
    for setting in settings:
        curve = [p for p in points if p.setting == setting]
        for ax, figure in zip(axes, ("ttft_p95_ms", "tpot_p95_ms"), strict=True):
            shown = [p for p in curve if getattr(p, figure) is not None]
            if not shown:
                continue
            style = "-s" if setting[0] == AUTO else "-o"
            ax.plot(
                [p.tokens_per_s for p in shown],
                [getattr(p, figure) for p in shown],
                style,
                label=curve[0].label,
            )
            for p in shown:
                ax.annotate(p.load, (p.tokens_per_s, getattr(p, figure)), fontsize=7, alpha=0.6)
    for ax, target, name in (
        (axes[0], targets.ttft_p95_ms, "TTFT p95 (ms)"),
        (axes[1], targets.tpot_p95_ms, "time per output token p95 (ms)"),
    ):
        if target is not None:
            ax.axhline(target, color="red", linestyle="--", linewidth=1, label="target")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].set_title("TTFT p95 against tokens/s (labels: load)")
    axes[1].set_title("TPOT p95 against tokens/s")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.12 + 0.03 * (len(settings) // 3), 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_all(
    runs: Sequence[GenPoint], targets: Targets, out: Path, *, header: str = ""
) -> list[Path]:
    """Every output file (the CSVs only while nothing was measured); a setting measured more
    than once at a level is reported as its medians, ``runs.csv`` keeps every run."""
    out.mkdir(parents=True, exist_ok=True)
    points = medians(runs)
    write_csv(points, out / "results.csv")
    write_csv(runs, out / "runs.csv")
    if not points:
        return [out / "results.csv"]
    paths = [out / "report.md", out / PLOT, out / "recommended.toml"]
    write_markdown(points, targets, paths[0], header=header)
    write_plot(points, targets, paths[1])
    write_toml(points, targets, paths[2])
    return [out / "results.csv", out / "runs.csv", *paths]
