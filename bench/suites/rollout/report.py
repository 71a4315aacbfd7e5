"""The rollout bench's tables: the switches, then the canaries, each with its targets."""

from __future__ import annotations

from typing import Any

P99_RATIO_TARGET = 1.5


def _num(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _p99(summary: dict[str, Any] | None) -> float | None:
    return None if not summary else summary["latency_ms"].get("p99")


def switch_rows(switches: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| switch | capacity req/s | load req/s | requests | failed | v1 answers after the "
        "switch | to first v2 answer s | to v1 unloaded s | p99 steady ms | p99 during ms "
        "| p99 after ms | during / steady |",
        "|" + "---|" * 12,
    ]
    for s in switches:
        name = s["kind"] if not s["simulated"] else f"{s['kind']}, simulated device"
        lines.append(
            f"| {name} | {s['capacity_rps']:.1f} | {s['rate']:.1f} ({s['factor']:g}x) "
            f"| {s['requests']:,} | {s['failed']} | {_num(s['v1_after_switch'], 'd')} "
            f"| {_num(s['to_first_v2_s'], '.2f')} | {_num(s['to_v1_unloaded_s'], '.2f')} "
            f"| {_num(_p99(s['steady']))} | {_num(_p99(s['during']))} "
            f"| {_num(_p99(s['after']))} | {_num(s['p99_ratio'], '.2f')} |"
        )
    return lines


def canary_rows(canaries: list[dict[str, Any]], window_s: float) -> list[str]:
    lines = [
        "| canary | one row ms (canary / stable) | req/s | to rollback s | within its window "
        "| reason | failed | allowed (share of the window) | canary answers after the rollback "
        "| p99 ms while both served (stable / canary) |",
        "|" + "---|" * 10,
    ]
    for c in canaries:
        both = c["while_both"]
        p99s = " / ".join(_num(both.get(v, {}).get("p99")) for v in ("1", "2"))
        lines.append(
            f"| {c['kind']} | {c['row_ms']['canary']:.1f} / {c['row_ms']['stable']:.1f} "
            f"| {c['rate']:g} | {_num(c['to_rollback_s'], '.2f')} "
            f"| {'yes' if c['within_window'] else '**no**'} ({window_s:g} s) "
            f"| {c['reason'] or '-'} | {c['failed']} | {c['allowed_failures']} "
            f"({c['share']:.0%} of {c['window_requests']}) "
            f"| {_num(c['canary_after_rollback'], 'd')} | {p99s} |"
        )
    return lines


def verdicts(results: dict[str, Any]) -> list[str]:
    """One line per target: met, or missed with the figure."""
    out = []
    real = [s for s in results["switch"] if not s["simulated"]]
    if real:
        ok = all(s["failed"] == 0 and s["v1_after_switch"] == 0 for s in real)
        out.append(
            "Target (switch: 0 failed requests, no answer from version 1 after the switch): "
            + ("met." if ok else "**missed**.")
        )
    for s in results["switch"]:
        if s["simulated"]:
            ratio = s["p99_ratio"]
            met = ratio is not None and ratio <= P99_RATIO_TARGET and s["failed"] == 0
            out.append(
                f"Target (simulated device, {s['factor']:g}x capacity: p99 during the switch "
                f"<= {P99_RATIO_TARGET:g}x steady, 0 failed): "
                + ("met" if met else "**missed**")
                + f" ({_num(ratio, '.2f')}x, {s['failed']} failed)."
            )
    for c in results["canary"]:
        want = "errors" if c["kind"] == "broken" else "latency"
        met = c["within_window"] and c["reason"] == want
        if c["kind"] == "broken":
            met = met and c["failed"] <= c["allowed_failures"]
        out.append(
            f"Target ({c['kind']} canary rolled back on {want} within its window"
            + (", failed <= its share" if c["kind"] == "broken" else "")
            + "): "
            + ("met." if met else "**missed**.")
        )
    return out


def render(results: dict[str, Any]) -> str:
    plan = results["plan"]
    lines: list[str] = []
    if results["switch"]:
        lines += switch_rows(results["switch"])
        lines += [
            "",
            f"Version 2 copied in (hidden directory, renamed) {plan['appear_at_s']:g} s into "
            f'{plan["switch_s"]:g} s of open-loop load, polled every 1 s; "during" runs from '
            "the rename to version 1's series gone from /metrics. Simulated device: "
            f"{plan['simulate_device_ms']:g} ms per batch, max_batch_size "
            f"{plan['simulated_batch']}, cpus_per_shard {plan['simulated_cpus_per_shard']:g}.",
            "",
        ]
    if results["canary"]:
        lines += canary_rows(results["canary"], plan["window_s"])
        lines += [
            "",
            f"[traffic] {100 - plan['canary_percent']}/{plan['canary_percent']}, [canary] "
            f"window_s {plan['window_s']:g}, min_requests {plan['min_requests']}, "
            f"error_margin 0.02, latency_factor 2; the canary copied in {plan['canary_at_s']:g} "
            f"s into {plan['canary_s']:g} s of load. Times are read from /metrics every 0.5 s.",
            "",
        ]
    lines += verdicts(results)
    return "\n".join(lines) + "\n"
