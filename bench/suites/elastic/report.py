"""The elastic bench's table: one row per stage, the replicas over time, and the targets."""

from __future__ import annotations

from typing import Any

GOODPUT_TARGET = 0.9
SHARE_503_TARGET = 0.01


def _num(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _row(name: str, rate: float, summary: dict[str, Any] | None, extra: str) -> str:
    if not summary:
        return f"| {name} | {rate:.1f} | - | - | - | - | - | {extra} |"
    lat = summary["latency_ms"]
    return (
        f"| {name} | {rate:.1f} | {summary['requests']:,} | {summary['goodput_rps']:.1f} "
        f"| {summary['failed']} | {summary['share_503']:.2%} | {_num(lat.get('p99'))} | {extra} |"
    )


def stage_rows(results: dict[str, Any]) -> list[str]:
    stages = results["stages"]
    lines = [
        "| stage | offered req/s | requests | goodput req/s | failed | 503 share | p99 ms | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if "low" in results:
        lines.append(_row("low", stages["low"]["rate"], results["low"]["whole"], ""))
    if "high" in results:
        high = results["high"]
        rate = stages["high"]["rate"]
        lines.append(
            _row(
                "high, whole",
                rate,
                high["whole"],
                f"p99 under target after {_num(high['to_p99_under_target_s'], '.1f')} s; "
                f"at most {_num(high['max_healthy'], 'g')} healthy replicas",
            )
        )
        lines.append(
            _row(
                "high, once scaled",
                rate,
                high["once_scaled"],
                f"goodput {_num(high['goodput_ratio'], '.2f')}x offered",
            )
        )
    if "quiet" in results:
        quiet = results["quiet"]
        lines.append(
            _row(
                "quiet",
                stages["quiet"]["rate"],
                quiet["whole"],
                f"back at the minimum after {_num(quiet['to_min_replicas_s'], '.1f')} s; "
                f"{quiet['scale_down_events']:g} scale-down events",
            )
        )
    if "steady" in results:
        steady = results["steady"]
        lines.append(
            _row(
                "steady",
                stages["steady"]["rate"],
                steady["whole"],
                f"{steady['scale_events']:g} scale events, healthy count changed "
                f"{steady['healthy_changes']} times",
            )
        )
    return lines


def verdicts(results: dict[str, Any], target_ms: float) -> list[str]:
    out = []
    high = results.get("high")
    if high:
        scaled = high["once_scaled"]
        ratio, share = high["goodput_ratio"], scaled["share_503"] if scaled else None
        met = (
            ratio is not None
            and ratio >= GOODPUT_TARGET
            and share is not None
            and share <= SHARE_503_TARGET
        )
        out.append(
            f"Target (high: p99 back under {target_ms:g} ms, then goodput >= "
            f"{GOODPUT_TARGET:g}x offered and 503s <= {SHARE_503_TARGET:.0%}): "
            + ("met" if met else "**missed**")
            + f" (after {_num(high['to_p99_under_target_s'])} s; {_num(ratio, '.2f')}x; "
            f"{'-' if share is None else format(share, '.2%')} 503s)."
        )
    quiet = results.get("quiet")
    if quiet:
        met = quiet["whole"]["failed"] == 0 and quiet["scale_down_events"] >= 1
        at_min = quiet["to_min_replicas_s"]
        out.append(
            "Target (quiet: scaled down after the quiet window with 0 failed requests): "
            + ("met" if met else "**missed**")
            + f" ({quiet['scale_down_events']:g} scale-down events, {quiet['whole']['failed']} "
            + "failed; "
            + (
                "never back at the minimum"
                if at_min is None
                else f"at the minimum after {at_min:g} s"
            )
            + ")."
        )
    steady = results.get("steady")
    if steady:
        met = steady["scale_events"] <= 1
        out.append(
            "Target (steady: the replica count changes at most once): "
            + ("met" if met else "**missed**")
            + f" ({steady['scale_events']:g} scale events)."
        )
    return out


def render(results: dict[str, Any]) -> str:
    plan, capacity = results["plan"], results["capacity"]
    over_time = ", ".join(f"{max(t, 0.0):.0f} s: {n:g}" for t, n in results["replicas_over_time"])
    lines = stage_rows(results)
    lines += [
        "",
        f"One replica: {capacity['computed_rps']:.1f} rows/s computed (max_batch_size "
        f"{plan['max_batch_size']} every {plan['simulate_device_ms']:g} ms), "
        f"{capacity['measured_rps']:.1f} measured; the stages' unit: "
        f"{capacity['unit_rps']:.1f} req/s. --min-replicas {plan['min_replicas']} "
        f"--max-replicas {plan['max_replicas']} --target-queue-wait-ms "
        f"{plan['target_queue_wait_ms']:g} --upscale-delay-s {plan['upscale_delay_s']:g} "
        f"--downscale-delay-s {plan['downscale_delay_s']:g} (short for the bench; the server's "
        f"default is 60) --cpus-per-shard {plan['cpus_per_shard']:g}; p99 in "
        f"{plan['window_s']:g} s windows, failures counted as infinitely slow.",
        f"Healthy replicas over time: {over_time or '-'}.",
        "",
        *verdicts(results, plan["p99_target_ms"]),
    ]
    return "\n".join(lines) + "\n"
