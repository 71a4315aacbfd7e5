"""The generation bench's arithmetic and table: percentiles of the client's latencies and of the
server's histograms, the medians over rounds, the capacity at a TTFT bound, and the Markdown."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from typing import Any

from bench.observe.scrape import Samples, delta

TTFT = "shardserve_time_to_first_token_seconds"
TPOT = "shardserve_time_per_output_token_seconds"
STEP_ROWS = "shardserve_generation_step_rows"
_LABEL = re.compile(r'(\w+)="([^"]*)"')
QUEUEING = 3.0  # p95 latency over the lowest rate's: the system fell behind

# Figures of one measurement that the rounds' medians are taken of.
FIGURES = (
    "tokens_per_s",
    "offered_tokens_per_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "tpot_p50_s",
    "tpot_p95_s",
    "latency_p50_s",
    "latency_p95_s",
    "rows_per_step",
    "errors",
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, linear between the closest ranks); None of nothing."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def buckets(after: Samples, before: Samples, name: str) -> list[tuple[float, float]]:
    """The cumulative (upper bound, count) pairs a histogram gained between two scrapes, in
    order of their bounds (``+Inf`` last)."""
    prefix = f"{name}_bucket{{"
    by_bound: dict[float, float] = {}
    for key in after:
        if key.startswith(prefix):
            # Summed over the series' other labels (a generation's TTFT has one per priority).
            labels = dict(_LABEL.findall(key[len(prefix) - 1 :]))
            bound = float(labels["le"])
            by_bound[bound] = by_bound.get(bound, 0.0) + delta(after, before, key)
    return sorted(by_bound.items())


def histogram_quantile(after: Samples, before: Samples, name: str, q: float) -> float | None:
    """Prometheus's ``histogram_quantile`` (``q`` in 0..1) over what the histogram gained:
    linear inside the bucket that holds the rank, the highest finite bound if it falls in
    ``+Inf``; None where nothing was observed."""
    pairs = buckets(after, before, name)
    if not pairs or pairs[-1][1] <= 0:
        return None
    rank = q * pairs[-1][1]
    low_bound, low_count = 0.0, 0.0
    for bound, count in pairs:
        if count >= rank:
            if math.isinf(bound):
                return low_bound
            if count == low_count:
                return bound
            return low_bound + (bound - low_bound) * (rank - low_count) / (count - low_count)
        low_bound, low_count = bound, count
    return low_bound


def histogram_mean(after: Samples, before: Samples, name: str) -> float | None:
    count = delta(after, before, f"{name}_count")
    return delta(after, before, f"{name}_sum") / count if count else None


def medians(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds of one system at one rate (rounds that lack it,
    e.g. a system that has no server histogram, are left out)."""
    out: dict[str, Any] = {"rounds": len(records)}
    for name in FIGURES:
        values = [r[name] for r in records if r.get(name) is not None]
        out[name] = statistics.median(values) if values else None
    return out


def capacity(by_rate: dict[float, dict[str, Any]], limit_s: float) -> float | None:
    """The highest rate whose median p95 TTFT is within ``limit_s`` with no request failed;
    None when no rate is."""
    good = [
        rate
        for rate, m in by_rate.items()
        if m.get("ttft_p95_s") is not None and m["ttft_p95_s"] <= limit_s and not m.get("errors")
    ]
    return max(good) if good else None


def queueing(latency_p95_s: float | None, base_p95_s: float | None) -> bool:
    """A system queues (falls behind) where its p95 latency passed ``QUEUEING`` x its own at the
    lowest rate: the scale of each system's latency apart (LitServe's whole answers are slow
    even alone), the growth is its backlog."""
    if latency_p95_s is None or not base_p95_s:
        return False
    return latency_p95_s > QUEUEING * base_p95_s


def kept_up(by_rate: dict[float, dict[str, Any]]) -> float | None:
    """The highest rate not ``queueing`` against the lowest one, none failed; None when even
    the lowest failed requests."""
    if not by_rate:
        return None
    base = by_rate[min(by_rate)].get("latency_p95_s")
    good = [
        rate
        for rate, m in by_rate.items()
        if not queueing(m.get("latency_p95_s"), base) and not m.get("errors")
    ]
    return max(good) if good else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per system: the medians at each rate, its capacity and best tokens/s; the ratios
    between the systems and against the ceiling."""
    limit = results["plan"]["ttft_limit_s"]
    systems: dict[str, Any] = {}
    for name in results["plan"]["systems"]:
        runs = [r for r in results["runs"] if r["system"] == name]
        by_rate: dict[float, dict[str, Any]] = {}
        for rate in sorted({r["rate"] for r in runs}):
            by_rate[rate] = medians([r for r in runs if r["rate"] == rate])
        best = max((m["tokens_per_s"] or 0.0 for m in by_rate.values()), default=0.0)
        cap = capacity(by_rate, limit)
        systems[name] = {
            "by_rate": by_rate,
            "capacity_rps": cap,
            "kept_up_rps": kept_up(by_rate),
            "tokens_per_s_at_capacity": by_rate[cap]["tokens_per_s"] if cap else None,
            "best_tokens_per_s": best or None,
        }
    ceiling = (results.get("ceiling") or {}).get("tokens_per_s")
    ratios: dict[str, Any] = {}
    main, peer, one = (systems.get(k) for k in ("shardserve", "litserve", "shardserve-1group"))
    if main and peer:
        ratios["capacity_vs_litserve"] = ratio(main["capacity_rps"], peer["capacity_rps"])
        ratios["kept_up_vs_litserve"] = ratio(main["kept_up_rps"], peer["kept_up_rps"])
        ratios["best_tokens_vs_litserve"] = ratio(
            main["best_tokens_per_s"], peer["best_tokens_per_s"]
        )
    if main and one:
        ratios["best_tokens_vs_one_group"] = ratio(
            main["best_tokens_per_s"], one["best_tokens_per_s"]
        )
        ratios["capacity_vs_one_group"] = ratio(main["capacity_rps"], one["capacity_rps"])
    for name, system in systems.items():
        ratios[f"{name}_best_tokens_vs_ceiling"] = ratio(system["best_tokens_per_s"], ceiling)
    at_rate: dict[float, dict[str, float | None]] = {}
    if main and peer:  # where both ran: the same arrivals, the same requests
        for rate in sorted(set(main["by_rate"]) & set(peer["by_rate"])):
            m, p = main["by_rate"][rate], peer["by_rate"][rate]
            at_rate[rate] = {
                "ttft_p95_litserve_over_shardserve": ratio(p["ttft_p95_s"], m["ttft_p95_s"]),
                "latency_p50_litserve_over_shardserve": ratio(
                    p["latency_p50_s"], m["latency_p50_s"]
                ),
            }
    return {
        "systems": systems,
        "ratios": ratios,
        "at_rate": at_rate,
        "ceiling_tokens_per_s": ceiling,
    }


def _f(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f}"


def render(results: dict[str, Any]) -> str:
    plan = results["plan"]
    summary = summarize(results)
    lines = [
        f"Model: {results['model']}; {plan['stages']} stages, {plan['batch']} KV slots (the "
        f"peer's max batch and the ceiling's batch too), prompts {plan['min_prompt']}.."
        f"{plan['max_prompt']} ids, max_tokens uniform {plan['min_tokens']}.."
        f"{plan['max_tokens']}, stop ids off, greedy; Poisson arrivals, {plan['duration_s']:g} s "
        f"per rate, medians of {plan['rounds']} round(s).",
        "",
        "| system | req/s offered | tokens/s (offered) | TTFT p50 / p95 ms | TPOT p50 / p95 ms "
        "| latency p50 / p95 ms | rows/step | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, system in summary["systems"].items():
        for rate, m in system["by_rate"].items():
            lines.append(
                f"| {name} | {rate:g} | {_f(m['tokens_per_s'], 1)} "
                f"({_f(m['offered_tokens_per_s'], 1)}) "
                f"| {_ms(m['ttft_p50_s'])} / {_ms(m['ttft_p95_s'])} "
                f"| {_ms(m['tpot_p50_s'])} / {_ms(m['tpot_p95_s'])} "
                f"| {_ms(m['latency_p50_s'])} / {_ms(m['latency_p95_s'])} "
                f"| {_f(m['rows_per_step'], 1)} | {_f(m['errors'], 0)} |"
            )
    lines += [
        "",
        f"Capacity (highest rate with p95 TTFT <= {plan['ttft_limit_s']:g} s, none failed):",
    ]
    for name, system in summary["systems"].items():
        cap, up = system["capacity_rps"], system["kept_up_rps"]
        lines.append(
            f"- {name}: {'below the lowest rate' if cap is None else f'{cap:g} req/s'}"
            f" ({_f(system['tokens_per_s_at_capacity'], 1)} tokens/s there; best "
            f"{_f(system['best_tokens_per_s'], 1)} tokens/s; highest rate kept up "
            f"(p95 latency <= {QUEUEING:g} x its own at the lowest rate): "
            f"{'none' if up is None else f'{up:g} req/s'})"
        )
    ceiling = results.get("ceiling")
    if ceiling:
        lines.append(
            f"- keras_hub generate alone, batch {ceiling['batch']}, one process: "
            f"{ceiling['tokens_per_s']:.1f} useful tokens/s ({ceiling['batches']} batches, "
            f"{ceiling['batch_s_p50']:.2f} s each at the median)"
        )
    named = {
        "capacity_vs_litserve": "capacity, shardserve / LitServe",
        "kept_up_vs_litserve": "highest rate kept up, shardserve / LitServe",
        "best_tokens_vs_litserve": "best tokens/s, shardserve / LitServe",
        "best_tokens_vs_one_group": "best tokens/s, K+1 groups / 1 group",
        "capacity_vs_one_group": "capacity, K+1 groups / 1 group",
    }
    lines += ["", "Ratios:"]
    for key, value in summary["ratios"].items():
        label = named.get(key, key.replace("_", " "))
        lines.append(f"- {label}: {_f(value)}")
    for rate, r in summary["at_rate"].items():
        lines.append(
            f"- at {rate:g} req/s, LitServe / shardserve: p95 TTFT "
            f"{_f(r['ttft_p95_litserve_over_shardserve'], 1)}x, median latency "
            f"{_f(r['latency_p50_litserve_over_shardserve'])}x"
        )
    cpu = _cpu_lines(results)
    if cpu:
        lines += [
            "",
            "Where the CPU went (cores, median over rounds) at each system's highest rate:",
        ]
        lines += cpu
    lines += [
        "",
        "TTFT and TPOT of shardserve are its own histograms (`shardserve_time_to_first_token_"
        "seconds`, `..._time_per_output_token_seconds`, interpolated inside their buckets: "
        "coarse): the route answers whole, not streamed. LitServe's answer comes whole at the end "
        "of its batch, so its TTFT is its full latency, and its TPOT is latency / tokens. "
        "tokens/s counts the ids answered (useful tokens) over the time from the first arrival "
        "to the last answer; latency counts from when a request was due.",
    ]
    return "\n".join(lines) + "\n"


def _cpu_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    for name in results["plan"]["systems"]:
        runs = [r for r in results["runs"] if r["system"] == name and r.get("cpu")]
        if not runs:
            continue
        top = max(r["rate"] for r in runs)
        at = [r["cpu"] for r in runs if r["rate"] == top]
        parts = sorted({k for c in at for k in c})
        shown = ", ".join(f"{k} {statistics.median(c.get(k, 0.0) for c in at):.2f}" for k in parts)
        lines.append(f"- {name} at {top:g} req/s: {shown}")
    return lines
