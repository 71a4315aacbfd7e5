"""``bench frontcpu``'s results as numbers and a table: per workload and protocol, the ms of
front-end CPU per request of each tree per round, new/old per round and the ratio of the medians;
with ``--tracing``, each tracing mode's median and its ratio to ``off``."""

from __future__ import annotations

import math
import statistics
from typing import Any

# Issue 18: the move into packages may cost the front end at most 5% more CPU per request.
LIMIT = 1.05
TREES = ("old", "new")


def _cells(
    windows: list[dict[str, Any]],
) -> list[tuple[tuple[str, str], list[dict[str, Any]], dict[int, dict[str, float]]]]:
    """The windows per (workload, protocol), in the order measured, with each round's ms
    CPU/req per tree (or tracing mode)."""
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for window in windows:
        cells.setdefault((window["workload"], window["protocol"]), []).append(window)
    out = []
    for cell, mine in cells.items():
        by_round: dict[int, dict[str, float]] = {}
        for window in mine:
            by_round.setdefault(window["round"], {})[window["tree"]] = window["cpu_ms_per_request"]
        out.append((cell, mine, by_round))
    return out


def summarize(windows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (workload, protocol), in the order they were measured: per round each
    tree's ms CPU/req and their ratio (the two windows of a round ran next to each other), and
    the ratio new/old of the medians over the rounds."""
    out = []
    for (workload, protocol), mine, by_round in _cells(windows):
        rounds = [
            {
                **{t: ms.get(t) for t in TREES},
                "round": r,
                "ratio": _ratio(ms.get("new"), ms.get("old")),
            }
            for r, ms in sorted(by_round.items())
        ]
        medians = {t: _median([r[t] for r in rounds]) for t in TREES}
        ratio = _ratio(medians["new"], medians["old"])
        # A window of failed answers measures the error path, not the one being compared.
        errors = sum(w["errors"] for w in mine)
        out.append(
            {
                "workload": workload,
                "protocol": protocol,
                "rounds": rounds,
                "old_median_ms": medians["old"],
                "new_median_ms": medians["new"],
                "ratio": ratio,
                "errors": errors,
                "within_limit": ratio is not None and ratio <= LIMIT and not errors,
            }
        )
    return out


def summarize_modes(windows: list[dict[str, Any]], modes: tuple[str, ...]) -> list[dict[str, Any]]:
    """``--tracing``'s cells, one per (workload, protocol): each mode's ms CPU/req per round and
    its median over the rounds, and each median's ratio to the first mode's (``off`` where it is
    measured)."""
    out = []
    for (workload, protocol), mine, by_round in _cells(windows):
        medians = {m: _median([ms.get(m) for ms in by_round.values()]) for m in modes}
        base = "off" if "off" in modes else modes[0]
        out.append(
            {
                "workload": workload,
                "protocol": protocol,
                "baseline": base,
                "rounds": [{"round": r, **ms} for r, ms in sorted(by_round.items())],
                "median_ms": medians,
                "ratio": {m: _ratio(medians[m], medians[base]) for m in modes},
                "errors": sum(w["errors"] for w in mine),
            }
        )
    return out


def render(results: dict[str, Any]) -> str:
    if "modes" in results:
        return _render_modes(results)
    trees = ", ".join(
        f"{label} = {t['commit']}{' + local edits' if t['dirty'] else ''} ({t['path']})"
        for label, t in results["trees"].items()
    )
    plan = results["plan"]
    lines = [
        f"Front-end CPU per request (server process utime + stime / answers), {plan['rounds']} "
        f"rounds of {plan['window_s']:g} s wrk windows, old and new interleaved; trees: {trees}",
        "",
        "| workload | protocol | clients | old ms CPU/req (median) | new ms CPU/req (median) | "
        f"new/old of medians | new/old per round | <= {LIMIT:g} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in results["summary"]:
        per_round = ", ".join(_num(r["ratio"], 3) for r in cell["rounds"])
        lines.append(
            f"| {cell['workload']} | {cell['protocol']} | {plan['clients'][cell['workload']]} | "
            f"{_num(cell['old_median_ms'])} | {_num(cell['new_median_ms'])} | "
            f"{_num(cell['ratio'], 3)} | {per_round} | {_verdict(cell)} |"
        )
    lines += ["", "Each window (in the order run):", ""]
    lines += [
        # CPU per request falls as batches fill: the batch size says whether two windows compare.
        "| workload | protocol | round | tree | ms CPU/req | answers | req/s | p99 ms | errors | "
        "mean batch rows | front end cores | load generator cores | rest of machine cores | "
        "1-min load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in results["windows"]:
        lines.append(
            f"| {w['workload']} | {w['protocol']} | {w['round']} | {w['tree']} | "
            f"{_num(w['cpu_ms_per_request'])} | {w['served']:.0f} | {w['rps']:,.0f} | "
            f"{w['p99_ms']:.1f} | {w['errors']} | {w['mean_batch_rows']:.1f} | "
            f"{w['frontend_cores']:.2f} | "
            f"{w['loadgen_cores']:.2f} | {w['cores'].get('others', 0.0):.2f} | "
            f"{w['loadavg'][0]:.2f} -> {w['loadavg'][1]:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _render_modes(results: dict[str, Any]) -> str:
    plan = results["plan"]
    (tree,) = {(t["commit"], t["dirty"], t["path"]) for t in results["trees"].values()}
    modes = list(results["trees"])
    sink = results.get("sink", {})
    lines = [
        f"Front-end CPU per request by tracing mode (server process utime + stime / answers), "
        f"{plan['rounds']} rounds of {plan['window_s']:g} s windows, the modes interleaved; "
        f"tree {tree[0]}{' + local edits' if tree[1] else ''} ({tree[2]}); on = "
        "parentbased_traceidratio at the ratio, exported over OTLP/HTTP to a sink that drops "
        f"them ({sink.get('posts', 0)} posts, {sink.get('bytes', 0):,} bytes)",
        "",
        "| workload | protocol | clients | "
        + " | ".join(f"{m} ms CPU/req (median)" for m in modes)
        + " | "
        + " | ".join(f"{m} / off" for m in modes if m != "off")
        + " | errors |",
        "|" + "---|" * (4 + 2 * len(modes) - (1 if "off" in modes else 0)),
    ]
    for cell in results["modes"]:
        lines.append(
            f"| {cell['workload']} | {cell['protocol']} | {plan['clients'][cell['workload']]} | "
            + " | ".join(_num(cell["median_ms"][m]) for m in modes)
            + " | "
            + " | ".join(_num(cell["ratio"][m], 3) for m in modes if m != "off")
            + f" | {cell['errors']} |"
        )
    lines += ["", "Each window (in the order run):", ""]
    lines += [
        "| workload | protocol | round | mode | ms CPU/req | answers | req/s | p99 ms | errors | "
        "mean batch rows | front end cores | 1-min load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in results["windows"]:
        lines.append(
            f"| {w['workload']} | {w['protocol']} | {w['round']} | {w['tree']} | "
            f"{_num(w['cpu_ms_per_request'])} | {w['served']:.0f} | {w['rps']:,.0f} | "
            f"{w['p99_ms']:.1f} | {w['errors']} | {w['mean_batch_rows']:.1f} | "
            f"{w['frontend_cores']:.2f} | {w['loadavg'][0]:.2f} -> {w['loadavg'][1]:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _verdict(cell: dict[str, Any]) -> str:
    if cell["errors"]:
        return f"n/a: {cell['errors']} errors"
    if cell["ratio"] is None:
        return "n/a"
    return "yes" if cell["within_limit"] else "NO"


def _ratio(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or not math.isfinite(new) or not math.isfinite(old) or old <= 0:
        return None
    return round(new / old, 4)


def _median(values: list[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else None


def _num(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"
