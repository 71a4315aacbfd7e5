"""``python -m bench openloop`` and ``python -m bench padding``: the batching policy's benches.

openloop (issue 13): one server (heavy model, 2 stages, max batch 32, admin token), its capacity
measured closed loop (the best of the policies at ``capacity_clients``), then Poisson arrivals
at fractions of that capacity; at every rate each policy (fixed timeouts and auto, switched with
``PUT /admin/batching``) is measured once per repeat, the order rotated each repeat so that a
drift of the machine touches every policy alike. Reported: medians and spread of p50, p99 and
req/s, and auto against the best fixed timeout's p99 at each rate.

padding: the same server at c clients of ``rows`` rows each, batches padded to 32 rows
(``--allowed-batch-sizes 32``) or run at their row count (the CPU default), interleaved.
"""

from __future__ import annotations

import os
import statistics
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from bench import options
from bench.load.loops import closed_loop, open_loop
from bench.models.workloads import get_workload, save_workload
from bench.observe.quiet import other_benches
from bench.observe.scrape import (
    base_url,
    batches_and_rows,
    delta,
    free_port,
    mean_batch_rows,
    scrape,
)
from bench.options import Progress
from bench.systems import ServerProcess, SystemConfig
from bench.systems.base import LaunchSpec
from bench.systems.shardserve import shardserve_spec

TOKEN = "bench-batching"
_PADDED = "shardserve_batch_padded_size_rows"


@dataclass(frozen=True)
class BatchingPlan:
    workload: str = "heavy"
    stages: int = 2
    max_batch_size: int = 32
    policies: tuple[str, ...] = ("0", "2", "5", "10", "auto")
    fractions: tuple[float, ...] = (0.3, 0.6, 0.9)
    capacity_clients: int = 64
    capacity_s: float = 8.0
    seconds: float = 10.0
    warmup_s: float = 2.0
    repeats: int = 3
    # padding
    clients: int = 16
    rows: int = 17
    max_inflight_batches: int = 16
    port: int = 0
    workdir: Path = Path(".bench")


def _spec(plan: BatchingPlan, port: int, flags: dict[str, str] | None = None) -> LaunchSpec:
    model = save_workload(plan.workload, plan.workdir)
    config = SystemConfig(model, port, plan.max_batch_size, 5.0)
    flags = {"--admin-token": TOKEN, **(flags or {})}
    return shardserve_spec(config, plan.stages, plan.workdir / "cache", flags=flags)


def set_policy(base: str, changes: dict[str, Any]) -> None:
    request = urllib.request.Request(
        f"{base}/admin/batching",
        data=orjson.dumps(changes),
        method="PUT",
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def _timeout(policy: str) -> float | str:
    return "auto" if policy == "auto" else float(policy)


def _measured(base: str, load: Callable[[], Any]) -> dict[str, Any]:
    before = scrape(base)
    result = load()
    after = scrape(base)
    batches, _ = batches_and_rows(after, before)
    return {
        **result.to_json(),
        "mean_batch_rows": mean_batch_rows(after, before),
        "mean_padded_rows": delta(after, before, f"{_PADDED}_sum") / batches if batches else 0.0,
        "loadavg_1min": os.getloadavg()[0],
    }


def run_openloop(plan: BatchingPlan, progress: Progress = print) -> dict[str, Any]:
    port = plan.port or free_port()
    body = get_workload(plan.workload).request_body(1)
    log = plan.workdir / "logs" / "openloop.log"
    runs: list[dict[str, Any]] = []
    capacity: dict[str, float] = {}
    with ServerProcess(_spec(plan, port), port, body, log) as server:
        base = base_url(server.url)
        for policy in ("10", "auto"):  # the two that batched most in closed loop (run 5)
            set_policy(base, {"batch_timeout_ms": _timeout(policy)})
            closed_loop(server.url, body, plan.capacity_clients, 2.0)
            result = closed_loop(server.url, body, plan.capacity_clients, plan.capacity_s)
            capacity[policy] = result.rps
            progress(f"capacity ({policy} ms, c={plan.capacity_clients}): {result.rps:.1f} req/s")
        top = max(capacity.values())
        for repeat in range(plan.repeats):
            shift = repeat % len(plan.policies)
            order = (*plan.policies[shift:], *plan.policies[:shift])
            for fraction in plan.fractions:
                rate = round(top * fraction, 1)
                load = partial(
                    open_loop,
                    server.url,
                    body,
                    rate,
                    plan.seconds,
                    poisson=True,
                    skip_s=plan.warmup_s,
                )
                for policy in order:
                    set_policy(base, {"batch_timeout_ms": _timeout(policy)})
                    record = _measured(base, load)
                    record.update(policy=policy, fraction=fraction, repeat=repeat)
                    runs.append(record)
                    progress(
                        f"  r{repeat} {fraction:.0%} ({rate:g}/s) {policy:>4}: "
                        f"{record['rps']:.1f} req/s p50 {record['p50_ms']:.1f} p99 "
                        f"{record['p99_ms']:.1f} ms, {record['mean_batch_rows']:.1f} rows/batch, "
                        f"errors {record['errors']}, load {record['loadavg_1min']:.1f}"
                    )
    return {
        "bench": "openloop",
        "plan": options.plan_json(plan),
        "capacity": capacity,
        "runs": runs,
        "other_benches": other_benches(),
    }


def run_padding(plan: BatchingPlan, progress: Progress = print) -> dict[str, Any]:
    body = get_workload(plan.workload).request_body(plan.rows)
    variants = {"padded to 32": {"--allowed-batch-sizes": "32"}, "unpadded": {}}
    runs: list[dict[str, Any]] = []
    servers = {}
    for name, extra in variants.items():
        port = plan.port or free_port()
        flags = {
            "--batch-timeout-ms": "0",
            "--max-inflight-batches": str(plan.max_inflight_batches),
        }
        spec = _spec(plan, port, {**flags, **extra})
        log = plan.workdir / "logs" / f"padding-{name.replace(' ', '-')}.log"
        servers[name] = ServerProcess(spec, port, body, log)
    # One server at a time: two would share the cores.
    for repeat in range(plan.repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
        for name in order:
            with servers[name] as server:
                base = base_url(server.url)
                closed_loop(server.url, body, plan.clients, plan.warmup_s)
                record = _measured(
                    base, lambda: closed_loop(server.url, body, plan.clients, plan.seconds)
                )
            record.update(variant=name, repeat=repeat)
            runs.append(record)
            progress(
                f"  r{repeat} {name:>12}: {record['rps']:.1f} req/s p50 {record['p50_ms']:.1f} "
                f"p99 {record['p99_ms']:.1f} ms, {record['mean_batch_rows']:.1f} rows/batch "
                f"padded to {record['mean_padded_rows']:.1f}, load {record['loadavg_1min']:.1f}"
            )
            time.sleep(1.0)  # the previous server's Ray going away
    return {"bench": "padding", "plan": options.plan_json(plan), "runs": runs}


def _label(policy: str) -> str:
    return "auto" if policy == "auto" else f"{policy} ms"


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def render(results: dict[str, Any]) -> str:
    if results["bench"] == "padding":
        return _render_padding(results)
    plan, runs = results["plan"], results["runs"]
    cap = results["capacity"]
    lines = [
        f"Capacity (closed loop, c={plan['capacity_clients']}): "
        + ", ".join(f"{_label(p)} {v:.1f} req/s" for p, v in cap.items())
        + f"; rates are fractions of {max(cap.values()):.1f} req/s. Poisson arrivals, "
        f"{plan['seconds']:g} s per point after {plan['warmup_s']:g} s uncounted; "
        f"medians of {plan['repeats']} interleaved repeats (min-max).",
        "",
        "| rate | policy | p50 ms | p99 ms | req/s | rows/batch |",
        "|---|---|---|---|---|---|",
    ]
    verdicts = []
    for fraction in plan["fractions"]:
        p99s = {}
        rps = {}
        for policy in plan["policies"]:
            mine = [r for r in runs if r["fraction"] == fraction and r["policy"] == policy]
            if not mine:
                continue
            p99s[policy] = statistics.median(r["p99_ms"] for r in mine)
            rps[policy] = statistics.median(r["rps"] for r in mine)
            label = _label(policy)
            lines.append(
                f"| {fraction:.0%} | {label} | {_spread([r['p50_ms'] for r in mine])} | "
                f"{_spread([r['p99_ms'] for r in mine])} | {_spread([r['rps'] for r in mine])} | "
                f"{statistics.median(r['mean_batch_rows'] for r in mine):.1f} |"
            )
        fixed = {p: v for p, v in p99s.items() if p != "auto"}
        if "auto" in p99s and fixed:
            best = min(fixed, key=lambda p: fixed[p])
            ratio = p99s["auto"] / fixed[best]
            rps_ratio = rps["auto"] / rps[best]
            ok = ratio <= 1.10 and rps_ratio >= 0.99
            verdicts.append(
                f"- {fraction:.0%}: auto p99 {p99s['auto']:.1f} ms = {ratio:.0%} of the best fixed "
                f"({best} ms, {fixed[best]:.1f} ms); req/s {rps_ratio:.0%} of it: "
                f"{'within' if ok else 'NOT within'} the bar"
            )
    return "\n".join([*lines, "", *verdicts]) + "\n"


def _render_padding(results: dict[str, Any]) -> str:
    plan, runs = results["plan"], results["runs"]
    lines = [
        f"c={plan['clients']} closed loop, {plan['rows']} rows per request, max batch "
        f"{plan['max_batch_size']}, timeout 0, {plan['max_inflight_batches']} batches in flight, "
        f"{plan['stages']} stages; {plan['seconds']:g} s per run, medians of {plan['repeats']} "
        f"(min-max), one server at a time, order alternated.",
        "",
        "| batches | req/s | rows/s | p50 ms | p99 ms | rows/batch | padded rows/batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("padded to 32", "unpadded"):
        mine = [r for r in runs if r["variant"] == name]
        if not mine:
            continue
        lines.append(
            f"| {name} | {_spread([r['rps'] for r in mine])} | "
            f"{statistics.median(r['rps'] for r in mine) * plan['rows']:.0f} | "
            f"{_spread([r['p50_ms'] for r in mine])} | {_spread([r['p99_ms'] for r in mine])} | "
            f"{statistics.median(r['mean_batch_rows'] for r in mine):.1f} | "
            f"{statistics.median(r['mean_padded_rows'] for r in mine):.1f} |"
        )
    return "\n".join(lines) + "\n"


ABOUT = {
    "openloop": "auto vs fixed timeouts under Poisson arrivals at fractions of capacity",
    "padding": "padded vs unpadded batches, closed loop (c clients of rows rows)",
}


def add_parsers(sub: Any) -> None:
    for command, run in (("openloop", run_openloop), ("padding", run_padding)):
        out = "docs/bench-batching"
        opts = options.suite(
            sub, command, ABOUT[command], out=out, plan=BatchingPlan, run=run, render=render
        )
        opts.add("workload", "stages", "max_batch_size", "seconds", "warmup_s")
        opts.add("repeats", "port", "workdir")
        if command == "openloop":
            opts.own("--policies", type=options.csv)
            opts.own("--fractions", type=options.floats)
            opts.add("capacity_clients", "capacity_s")
        else:
            opts.add("clients")
            opts.own("--rows", type=int)
            opts.own("--max-inflight-batches", type=int)
