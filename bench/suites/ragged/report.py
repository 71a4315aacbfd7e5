"""The ragged bench's table and verdicts: mixed against uniform lengths, length padded against
one queue per length, the exactness of the answers and the waste of the padding."""

from __future__ import annotations

import statistics
from typing import Any

# The bars of issue 19: mixed lengths at least this share of uniform ones' req/s, and length
# padded at least this multiple of one queue per length on the mixed load.
MIXED_OVER_UNIFORM = 0.8
PADDED_OVER_UNPADDED = 2.0


def median_of(runs: list[dict[str, Any]], variant: str, load: str, key: str) -> float | None:
    values = [r[key] for r in runs if r["variant"] == variant and r["load"] == load]
    return statistics.median(values) if values else None


def waste_of(runs: list[dict[str, Any]], variant: str) -> float | None:
    """Pad positions per real position over every mixed run of ``variant``."""
    mine = [r["positions"] for r in runs if r["variant"] == variant and r["load"] == "mixed"]
    real = sum(p["real"] for p in mine)
    return sum(p["pad"] for p in mine) / real if real else None


def ratios(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Median req/s of mixed over uniform (one server), and length padded over unpadded."""
    mixed = median_of(runs, "padded", "mixed", "rps")
    uniform = median_of(runs, "padded", "uniform", "rps")
    unpadded = median_of(runs, "unpadded", "mixed", "rps")
    return {
        "mixed_over_uniform": mixed / uniform if mixed is not None and uniform else None,
        "padded_over_unpadded": mixed / unpadded if mixed is not None and unpadded else None,
    }


def _bar(value: float | None, target: float, what: str) -> str:
    if value is None:
        return f"- {what}: not measured (target >= {target:g})"
    verdict = "met" if value >= target else "NOT met"
    return f"- {what}: {value:.2f}x (target >= {target:g}x): {verdict}"


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def _diff(value: float | None, tolerance: float) -> str:
    if value is None:
        return "could not compare (see problems)"
    return f"{value:.2e} ({'within' if value <= tolerance else 'NOT within'} {tolerance:g})"


def _exactness_lines(exactness: dict[str, Any], tolerance: float) -> list[str]:
    lines = []
    padded = exactness.get("padded")
    if padded:
        lines.append(
            f"- exactness, {padded['rows']} rows of mixed lengths sent together "
            f"({padded['batches']:.0f} batches): max |difference| from the row alone through "
            f"the server {_diff(padded.get('batched_vs_alone'), tolerance)}; from the model "
            f"itself on the row alone {_diff(padded['batched_vs_model'], tolerance)}"
        )
    unpadded = exactness.get("unpadded")
    if unpadded:
        lines.append(
            f"- exactness, --no-pad-lengths: from the model on the row alone "
            f"{_diff(unpadded['batched_vs_model'], tolerance)}"
        )
    for record in (padded, unpadded):
        lines += [f"  - {problem}" for problem in (record or {}).get("problems", [])]
    return lines


def _waste(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# (variant, load) in the table's order, and how each row is named.
ROWS = (
    ("padded", "uniform", "uniform {max}", "length padded, {timeout:g} ms"),
    ("padded", "mixed", "mixed {min}..{max}", "length padded, {timeout:g} ms"),
    ("auto", "mixed", "mixed {min}..{max}", "length padded, auto timeout"),
    ("unpadded", "mixed", "mixed {min}..{max}", "`--no-pad-lengths` (before issue 19)"),
)


def render_model(name: str, model: dict[str, Any], plan: dict[str, Any]) -> list[str]:
    runs = model["runs"]
    names = {"min": plan["min_length"], "max": plan["max_length"]}
    lines = [
        f"**{name}** ({model['about']}), {plan['stages']} stages",
        "",
        "| load | server | req/s | p50 ms | p99 ms | rows/batch | pad/real positions | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, load, load_name, server in ROWS:
        mine = [r for r in runs if r["variant"] == variant and r["load"] == load]
        if not mine:
            continue
        pad = _waste(waste_of(mine, variant)) if load == "mixed" else "-"
        lines.append(
            f"| {load_name.format(**names)} | "
            f"{server.format(timeout=plan['batch_timeout_ms'])} | "
            f"{_spread([r['rps'] for r in mine])} | {_spread([r['p50_ms'] for r in mine])} | "
            f"{_spread([r['p99_ms'] for r in mine])} | "
            f"{statistics.median(r['mean_batch_rows'] for r in mine):.1f} | {pad} | "
            f"{sum(r['errors'] for r in mine)} |"
        )
    got = ratios(runs)
    lines += [
        "",
        _bar(got["mixed_over_uniform"], MIXED_OVER_UNIFORM, "req/s mixed / uniform"),
        _bar(
            got["padded_over_unpadded"],
            PADDED_OVER_UNPADDED,
            "req/s mixed, length padded / --no-pad-lengths",
        ),
        f"- length-padding waste (pad / real positions, mixed load): "
        f"{_waste(waste_of(runs, 'padded'))} at {plan['batch_timeout_ms']:g} ms, "
        f"{_waste(waste_of(runs, 'auto'))} with the cost model choosing batch sizes (auto)",
        *_exactness_lines(model["exactness"], model["tolerance"]),
        "",
    ]
    return lines


def render_unsafe(unsafe: dict[str, Any]) -> list[str]:
    lines = [
        f"**{unsafe['name']}** ({unsafe['about']}): a model length padding would change",
        "",
    ]
    for label, server in unsafe["servers"].items():
        counted, exact = server["positions"], server["exactness"]
        unpadded = counted["pad"] == 0 and counted["real"] == 0
        flags = " ".join(f"`{flag}`" for flag in server["flags"]) or "no flag"
        said = "; ".join(server["log_lines"]) or "(no warning about length padding)"
        lines += [
            f"- served {label} ({flags}): V2 metadata parameters `{server['parameters']}`; "
            f"server log: {said}",
            f"  - {'unpadded' if unpadded else 'LENGTH PADDED'}: {exact['rows']} rows sent "
            f"together ran in {exact['batches']:.0f} batches with {counted['pad']:.0f} pad "
            f"positions; max |difference| from the model on the row alone "
            f"{_diff(exact['batched_vs_model'], unsafe['tolerance'])}",
            *[f"  - {problem}" for problem in exact.get("problems", [])],
        ]
    return [*lines, ""]


def render(results: dict[str, Any]) -> str:
    plan = results["plan"]
    pinned = ", the load generator on a core of its own" if plan["pin"] else ""
    lines = [
        f"{plan['clients']} closed-loop clients, each request one row: mixed lengths uniform in "
        f"{plan['min_length']}..{plan['max_length']} (seed {plan['seed']}) or uniform "
        f"{plan['max_length']}-token rows; max batch {plan['max_batch_size']}, "
        f"`--max-sequence-length {plan['max_length']}`, the default length buckets; "
        f"{plan['seconds']:g} s per run after {plan['warmup_s']:g} s uncounted, medians of "
        f"{plan['repeats']} (min-max){pinned}. `--no-pad-lengths` is one queue per length: "
        "exactly the behaviour before issue 19.",
        "",
    ]
    for name, model in results["models"].items():
        lines += render_model(name, model, plan)
    if results.get("unsafe"):
        lines += render_unsafe(results["unsafe"])
    if results.get("other_benches"):
        lines.append(f"Other benches running meanwhile: {results['other_benches']}")
    return "\n".join(lines).rstrip() + "\n"
