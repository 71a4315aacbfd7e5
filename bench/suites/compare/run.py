"""The measurement plan: systems one after another, alternating order, each several times.

Per workload: the ceiling once, then ``repeats`` rounds; in round r the systems start in an
order rotated by r so that no system always runs first (cold machine) or last. Each system is
started fresh per round, warmed, and loaded closed loop at each concurrency and open loop at the
workload's fixed rate. Then the pipeline-overlap runs: shardserve with simulated stages.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench import options
from bench.load.loops import WRK_INSTALL_HINT, closed_loop, have_wrk, open_loop
from bench.load.result import LoadError
from bench.models.workloads import get_workload, save_workload
from bench.observe.cpusplit import CpuSeconds, cores, cpu_seconds, per_work
from bench.observe.procinfo import read_proc
from bench.observe.scrape import BATCH_ROWS, Samples, base_url, batches_and_rows, scrape
from bench.options import Progress
from bench.suites.compare.report import plot, render
from bench.systems import ServerProcess, SystemConfig, launch_spec
from bench.systems.base import ServerStartError
from bench.systems.ceiling import measure_ceiling


@dataclass(frozen=True)
class Plan:
    workloads: tuple[str, ...] = ("heavy", "light")
    systems: tuple[str, ...] = ("shardserve-1", "shardserve-2", "litserve", "rayserve")
    repeats: int = 3
    seconds: float = 10.0
    warmup_s: float = 2.0
    concurrencies: tuple[int, ...] = (1, 64)
    open_rates: dict[str, float] = field(default_factory=lambda: {"heavy": 300.0, "light": 600.0})
    max_batch_size: int = 64
    batch_timeout_ms: float = 5.0
    ceiling_batch_sizes: tuple[int, ...] = (1, 64)
    ceiling_s: float = 5.0
    overlap_stages: tuple[int, ...] = (1, 2, 4)
    overlap_device_ms: float = 50.0
    overlap_batch_size: int = 16
    tool: str = "auto"
    port: int = 18431
    workdir: Path = Path(".bench")

    def __post_init__(self) -> None:
        options.require(self, at_least_one=("repeats",), positive=("seconds",))
        for workload in self.workloads:
            get_workload(workload)


def run_plan(
    plan: Plan,
    progress: Progress = print,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    results: dict[str, Any] = {
        "plan": options.plan_json(plan),
        "ceiling": {},
        "runs": [],
        "overlap": [],
        "failures": [],
    }
    for workload in plan.workloads:
        model = save_workload(workload, plan.workdir)
        progress(f"[{workload}] ceiling")
        results["ceiling"][workload] = measure_ceiling(
            model, plan.ceiling_batch_sizes, plan.ceiling_s
        )
        progress(f"[{workload}] ceiling: {results['ceiling'][workload]}")
        for repeat in range(plan.repeats):
            shift = repeat % len(plan.systems)
            for system in (*plan.systems[shift:], *plan.systems[:shift]):
                try:
                    results["runs"] += _run_system(plan, workload, model, system, repeat, progress)
                except (ServerStartError, LoadError) as exc:
                    # One broken round must not throw away the rounds already measured.
                    progress(f"  {system} round {repeat + 1} FAILED: {exc}")
                    results["failures"].append(
                        {
                            "workload": workload,
                            "system": system,
                            "repeat": repeat,
                            "error": str(exc),
                        }
                    )
                if checkpoint is not None:
                    checkpoint(results)
    if plan.overlap_stages:
        results["overlap"] = run_overlap(plan, progress)
    return results


def _run_system(
    plan: Plan, workload: str, model: Path, system: str, repeat: int, progress: Progress
) -> list[dict[str, Any]]:
    body = get_workload(workload).request_body()
    timeout: float | str = plan.batch_timeout_ms
    name = system
    if system.endswith("-auto"):
        timeout, name = "auto", system.removesuffix("-auto")
    config = SystemConfig(model, plan.port, plan.max_batch_size, timeout)
    spec = launch_spec(name, config, plan.workdir / "cache")
    log = plan.workdir / "logs" / f"{workload}-{system}-{repeat}.log"
    records = []
    progress(f"[{workload}] round {repeat + 1}/{plan.repeats}: starting {system}")
    with ServerProcess(spec, plan.port, body, log) as server:
        if plan.warmup_s > 0:  # wrk runs at least 1 s: 0 is no warm-up (the smoke test's)
            closed_loop(server.url, body, max(plan.concurrencies), plan.warmup_s, tool=plan.tool)
        scenarios: list[tuple[str, int | float]] = [(f"c{c}", c) for c in plan.concurrencies]
        rate = plan.open_rates.get(workload)
        if rate:
            scenarios.append((f"open{rate:g}", rate))
        for scenario, level in scenarios:
            split, metrics, tick = cpu_seconds(server.pid), _metrics(server.url), time.monotonic()
            if scenario.startswith("open"):
                result = open_loop(server.url, body, level, plan.seconds)
            else:
                result = closed_loop(server.url, body, int(level), plan.seconds, tool=plan.tool)
            work = where_time_goes(server.pid, server.url, split, metrics, tick, result.requests)
            proc = read_proc(server.pid)
            progress(
                f"  {system} {scenario}: {result.rps:,.0f} req/s p50 {result.p50_ms:.1f} ms "
                f"p99 {result.p99_ms:.1f} ms errors {result.errors}"
            )
            records.append(
                {
                    "workload": workload,
                    "system": system,
                    "repeat": repeat,
                    "scenario": scenario,
                    **result.to_json(),
                    "frontend": proc.to_json(),
                    **work,
                }
            )
    return records


def _metrics(predict_url: str) -> Samples | None:
    """The server's ``/metrics``, where it has shardserve's batch rows (LitServe and Ray Serve
    have none)."""
    try:
        samples = scrape(base_url(predict_url))
    except (OSError, ValueError):
        return None
    return samples if f"{BATCH_ROWS}_count" in samples else None


def where_time_goes(
    pid: int,
    predict_url: str,
    split: CpuSeconds,
    before: Samples | None,
    tick: float,
    requests: int,
) -> dict[str, Any]:
    """Beside a window's req/s: the mean batch rows (shardserve's ``/metrics``), the CPU per
    request of the front end and the rest of Ray, the model workers' per row (per request where
    the server counts no rows) and the share of the machine idle, from the cores each part used
    since ``split`` (taken at ``tick``)."""
    elapsed = time.monotonic() - tick
    parts = cores(split, cpu_seconds(pid), elapsed)
    after = _metrics(predict_url) if before is not None else None
    batches, rows = batches_and_rows(after, before) if after and before else (0.0, 0.0)
    return {
        "mean_batch_rows": rows / batches if batches else None,
        "cores": parts,
        **per_work(parts, elapsed, requests, rows or None, os.cpu_count() or 1),
    }


def run_overlap(plan: Plan, progress: Progress = print) -> list[dict[str, Any]]:
    """Pipelined throughput of K simulated stages over the ideal 1/T batches per second."""
    model = save_workload("heavy", plan.workdir)  # 9 layers: cuts into up to 9 stages
    body = get_workload("heavy").request_body()
    batch = plan.overlap_batch_size
    out = []
    for stages in plan.overlap_stages:
        for repeat in range(plan.repeats):
            config = SystemConfig(
                model, plan.port, batch, plan.batch_timeout_ms, plan.overlap_device_ms
            )
            spec = launch_spec(f"shardserve-{stages}", config, plan.workdir / "cache")
            log = plan.workdir / "logs" / f"overlap-{stages}-{repeat}.log"
            with ServerProcess(spec, plan.port, body, log) as server:
                # Enough clients that K batches are always in flight and the next one is full.
                clients = (stages + 2) * batch
                closed_loop(server.url, body, clients, plan.warmup_s, tool=plan.tool)
                before = _scrape_batches(server.url)
                tick = time.monotonic()
                result = closed_loop(server.url, body, clients, plan.seconds, tool=plan.tool)
                after = _scrape_batches(server.url)
                elapsed = time.monotonic() - tick
            batches, rows = batches_and_rows(after, before)
            per_s = batches / elapsed
            ideal = 1000.0 / plan.overlap_device_ms
            record = {
                "stages": stages,
                "repeat": repeat,
                "device_ms": plan.overlap_device_ms,
                "batch_size": batch,
                "batches_per_s": per_s,
                "mean_batch_rows": rows / batches if batches else 0.0,
                "ideal_batches_per_s": ideal,
                "efficiency": per_s / ideal,
                "rps": result.rps,
                "p99_ms": result.p99_ms,
            }
            progress(
                f"  overlap K={stages}: {per_s:.1f} batches/s of ideal {ideal:.1f} "
                f"(efficiency {per_s / ideal:.2f}, {record['mean_batch_rows']:.1f} rows/batch)"
            )
            out.append(record)
    return out


def _scrape_batches(predict_url: str) -> Samples:
    samples = scrape(base_url(predict_url))
    if f"{BATCH_ROWS}_count" not in samples:
        raise RuntimeError(f"{predict_url} has no {BATCH_ROWS} count/sum in its /metrics")
    return samples


def _rates(text: str) -> dict[str, float]:
    out = {}
    for part in options.csv(text):
        name, sep, rate = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"open rate {part!r} must look like heavy=300")
        out[name] = float(rate)
    return out


def add_parsers(sub: Any) -> None:
    """``run`` (measure, then write the report) and ``report`` (write it from saved results):
    they write ``bench_results.json``, ``benchmarks.md`` and plots, not a suite's table."""
    run = sub.add_parser("run", help="measure, then write the report")
    opts = options.Options(run, Plan())
    opts.add("workloads")
    opts.own("--systems", type=options.csv)
    opts.add("repeats", "seconds", "warmup_s")
    opts.add("concurrency", dest="concurrencies", type=options.ints)
    opts.own("--open-rates", type=_rates, default=None, help="heavy=300,light=600")
    opts.add("max_batch_size", "batch_timeout_ms")
    opts.own("--overlap-stages", type=options.ints)
    opts.own("--overlap-device-ms", type=float)
    opts.add("ceiling_s")
    opts.own("--tool", choices=("auto", "wrk", "python"))
    opts.add("port", "workdir")
    opts.add("out", default=Path("docs"))
    run.set_defaults(write=functools.partial(_run, run))
    report = sub.add_parser("report", help="re-render the report from saved results")
    report_opts = options.Options(report)
    report_opts.own("--results", type=Path, default=Path("docs/bench_results.json"))
    report_opts.add("out", default=Path("docs"))
    report.set_defaults(write=_report)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, command: str) -> int:
    if args.tool == "wrk" and not have_wrk():
        parser.error(f"--tool wrk: wrk is not installed; {WRK_INSTALL_HINT}")
    if args.tool == "auto" and not have_wrk():
        print(f"note: wrk missing, using the Python generator; {WRK_INSTALL_HINT}")
    plan = options.plan_from(Plan, args)
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / "bench_results.partial.json"
    results = run_plan(
        plan,
        progress=options.say,
        checkpoint=lambda r: partial.write_bytes(orjson.dumps(r, option=orjson.OPT_INDENT_2)),
    )
    partial.unlink(missing_ok=True)
    results["command"] = command
    return _write(results, command, args.out)


def _report(args: argparse.Namespace, command: str) -> int:
    results = orjson.loads(args.results.read_bytes())
    return _write(results, results.get("command", "python -m bench run"), args.out)


def _write(results: dict[str, Any], command: str, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    doc = out / "benchmarks.md"
    old = doc.read_text() if doc.is_file() else ""
    doc.write_text(render(results, command, old))
    plot(results, out)
    print(f"wrote {doc}")
    return 0
