"""``python -m bench overload``: does the server keep delivering its capacity when offered more?

One shardserve server (heavy model, 1 stage, max batch 64) and four phases in one run, all
driven by ``hey`` on 127.0.0.1:

1. **capacity**: C = good (200) answers/s of ``capacity_clients`` closed-loop clients;
2. **overload**: ``clients`` clients, each held to ``factor`` x C / ``clients`` requests/s, an
   offered load of 3C;
3. **overload, staggered**: the same offered load from the clients split over several hey
   processes started evenly over one tick of the rate limit: hey's rate-limited clients send
   in step, one burst of 1,500 requests per tick, and this phase shows what smaller bursts do;
4. **retry storm**: the same clients with no rate limit, each sending again as soon as it is
   answered (a 503 included).

Reported per phase: goodput as a ratio of C, the 503s' p99 as the clients saw it, and the front
end's RSS before and after. The targets are those of issue 10.

``--access-log off,json`` (issue 30: the access log's cost at 3x overload, its goodput within 5%
of the log off) runs instead one server per access-log setting, both up at once: C is measured
on the first, then the overload phase (the same offered 3C) runs on each in turn,
``--log-rounds`` times, the order flipped each round; reported: each setting's median goodput
and its ratio to ``off``'s. The log's lines go to the server's stdout (its log file), as a log
pipeline would read them.
"""

from __future__ import annotations

import contextlib
import math
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import options
from bench.load.hey import HEY_INSTALL_HINT, HeyResult, have_hey, run_hey
from bench.models.workloads import get_workload, save_workload
from bench.observe.cpusplit import cores, cpu_seconds
from bench.observe.procinfo import RssSampler, read_proc
from bench.observe.scrape import (
    Samples,
    base_url,
    batches_and_rows,
    delta,
    free_port,
    scrape,
    wait_idle,
)
from bench.options import Progress
from bench.systems import ServerProcess, SystemConfig
from bench.systems.shardserve import shardserve_spec

GOODPUT_TARGET = 0.8  # x C, in the overload phase
ACCESS_LOG_TARGET = 0.95  # goodput with the access log on, x goodput with it off (issue 30)
ACCESS_LOG_FORMS = ("off", "json", "text")
REJECT_P99_TARGET_MS = 20.0
RSS_GROWTH_TARGET_MB = 50.0
_LATENCY_COUNT = "shardserve_request_latency_seconds_count"


@dataclass(frozen=True)
class OverloadPlan:
    workload: str = "heavy"
    max_batch_size: int = 64
    batch_timeout_ms: float = 5.0
    warmup_s: float = 5.0
    capacity_clients: int = 256
    capacity_s: float = 20.0
    factor: float = 3.0
    clients: int = 1500
    overload_s: float = 40.0
    # A second overload phase with the clients split over this many hey processes started evenly
    # over one tick (hey sends each process's rate-limited clients in step); 0: none.
    staggered_groups: int = 10
    retry_s: float = 20.0
    port: int = 0  # 0: a free port, picked at start (other servers may run on this machine)
    workdir: Path = Path(".bench")
    # One server per access-log setting, overload goodput side by side (empty: the phases above).
    access_log: tuple[str, ...] = ()
    log_rounds: int = 2

    def __post_init__(self) -> None:
        get_workload(self.workload)
        options.require(
            self,
            at_least_one=("capacity_clients", "clients"),
            positive=("capacity_s", "overload_s", "retry_s", "factor"),
        )
        bad = [form for form in self.access_log if form not in ACCESS_LOG_FORMS]
        if bad or len(set(self.access_log)) != len(self.access_log):
            raise ValueError(
                f"access_log: distinct forms among {ACCESS_LOG_FORMS}, got {self.access_log}"
            )
        if self.access_log and self.log_rounds < 1:
            raise ValueError(f"log_rounds must be >= 1, got {self.log_rounds}")


def per_client_rate(capacity: float, factor: float, clients: int) -> float:
    """Each client's share of ``factor`` x capacity, rounded up to 0.01 req/s (hey's -q)."""
    return max(math.ceil(factor * capacity / clients * 100) / 100, 0.01)


def run_overload(plan: OverloadPlan, progress: Progress = print) -> dict[str, Any]:
    if not have_hey():
        raise SystemExit(f"the overload bench drives its load with hey; {HEY_INSTALL_HINT}")
    ensure_open_files(2 * max(plan.clients, plan.capacity_clients) + 1024)
    if plan.access_log:
        return _run_access_log(plan, progress)
    phases: list[dict[str, Any]] = []
    with _Server(plan, "", plan.port, progress) as server:
        phase = partial_phase(server, plan, phases, progress)
        capacity = phase("capacity", plan.capacity_clients, plan.capacity_s, None).per_s(200)
        if capacity <= 0:
            raise RuntimeError(
                f"no 200 answers at {plan.capacity_clients} clients; see {server.log}"
            )
        rate = per_client_rate(capacity, plan.factor, plan.clients)
        progress(
            f"  C = {capacity:,.0f} req/s; offering {plan.factor:g}C: {plan.clients} x {rate:g}/s"
        )
        phase("overload", plan.clients, plan.overload_s, rate)
        if plan.staggered_groups > 1:
            name = f"overload, {plan.staggered_groups} staggered hey"
            phase(name, plan.clients, plan.overload_s, rate, plan.staggered_groups)
        phase("retry storm", plan.clients, plan.retry_s, None)
    for record in phases:
        record["goodput_ratio"] = record["good_per_s"] / capacity
    return {"plan": options.plan_json(plan), "capacity": capacity, "phases": phases}


def _run_access_log(plan: OverloadPlan, progress: Progress) -> dict[str, Any]:
    """One server per access-log form, up at once; C on the first; the overload phase on each
    in turn, ``log_rounds`` times, the order flipped each round."""
    phases: list[dict[str, Any]] = []
    forms = plan.access_log
    with contextlib.ExitStack() as stack:
        servers = {}
        for i, form in enumerate(forms):
            port = plan.port if i == 0 and plan.port else free_port()
            servers[form] = stack.enter_context(_Server(plan, form, port, progress))
        first = servers[forms[0]]
        capacity = (
            partial_phase(first, plan, phases, progress)(
                f"capacity (access log {forms[0]})", plan.capacity_clients, plan.capacity_s, None
            )
        ).per_s(200)
        if capacity <= 0:
            raise RuntimeError(
                f"no 200 answers at {plan.capacity_clients} clients; see {first.log}"
            )
        rate = per_client_rate(capacity, plan.factor, plan.clients)
        progress(
            f"  C = {capacity:,.0f} req/s; offering {plan.factor:g}C: {plan.clients} x {rate:g}/s"
            " to each access-log setting in turn"
        )
        for round_ in range(plan.log_rounds):
            for form in forms if round_ % 2 == 0 else forms[::-1]:
                phase = partial_phase(servers[form], plan, phases, progress)
                phase(f"overload (access log {form})", plan.clients, plan.overload_s, rate)
                phases[-1].update(access_log=form, round=round_)
    for record in phases:
        record["goodput_ratio"] = record["good_per_s"] / capacity
    return {
        "plan": options.plan_json(plan),
        "capacity": capacity,
        "phases": phases,
        "access_log": summarize_access_log(phases, forms),
    }


def summarize_access_log(phases: list[dict[str, Any]], forms: tuple[str, ...]) -> dict[str, Any]:
    """Per access-log form: its overload phases' goodputs, their median, and that median's ratio
    to the first form's (``off`` where it is measured)."""
    base = "off" if "off" in forms else forms[0]
    good = {f: [p["good_per_s"] for p in phases if p.get("access_log") == f] for f in forms}
    medians = {f: statistics.median(v) if v else 0.0 for f, v in good.items()}
    return {
        "baseline": base,
        "good_per_s": good,
        "median_good_per_s": medians,
        "ratio": {f: medians[f] / medians[base] if medians[base] else None for f in forms},
    }


class _Server:
    """The bench's server (``--access-log form``; "": the server's default), warmed up."""

    def __init__(self, plan: OverloadPlan, form: str, port: int, progress: Progress) -> None:
        model = save_workload(plan.workload, plan.workdir)
        self.body = get_workload(plan.workload).request_body()
        self.port = port or free_port()
        config = SystemConfig(model, self.port, plan.max_batch_size, plan.batch_timeout_ms)
        # Two servers up at once: neither takes the default gRPC port (the load is HTTP).
        flags = {"--access-log": form, "--grpc-port": "0"} if form else {}
        self.spec = shardserve_spec(config, 1, plan.workdir / "cache", flags=flags)
        suffix = f"-log-{form}" if form else ""
        self.log = plan.workdir / "logs" / f"overload-{plan.workload}{suffix}.log"
        self.form = form
        self._plan = plan
        self._progress = progress
        self._stack = contextlib.ExitStack()
        self.url = ""
        self.pid = 0

    def __enter__(self) -> _Server:
        what = f"{self.spec.name} on {self._plan.workload}"
        self._progress(
            f"[overload] starting {what}"
            + (f", access log {self.form}" if self.form else "")
            + f" (log: {self.log})"
        )
        server = self._stack.enter_context(ServerProcess(self.spec, self.port, self.body, self.log))
        self.url, self.pid = server.url, server.pid
        run_hey(self.url, self.body, self._plan.capacity_clients, self._plan.warmup_s)
        wait_idle(base_url(self.url), 60.0, 0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def partial_phase(
    server: _Server, plan: OverloadPlan, phases: list[dict[str, Any]], progress: Progress
) -> Callable[..., HeyResult]:
    """``phase(name, clients, seconds, rate, groups=1)`` on ``server``: one hey run, its record
    appended to ``phases``."""
    url = server.url

    def phase(
        name: str, clients: int, seconds: float, rate: float | None, groups: int = 1
    ) -> HeyResult:
        before, rss_before = scrape(base_url(url)), read_proc(server.pid)
        cpu_before, tick = cpu_seconds(server.pid), time.monotonic()
        slug = name.replace(" ", "-").replace("(", "").replace(")", "")
        raw = plan.workdir / "logs" / f"overload-{slug}.csv"
        with RssSampler(server.pid, interval_s=2.0) as rss:
            result = run_hey(
                url,
                server.body,
                clients,
                seconds,
                rate_per_client=rate,
                groups=groups,
                keep_csv=raw,
            )
        used = cores(cpu_before, cpu_seconds(server.pid), time.monotonic() - tick)
        after, rss_after = scrape(base_url(url)), read_proc(server.pid)
        phases.append(_record(name, result, before, after, rss_before.rss_mb, rss_after))
        phases[-1].update(cores=used, rss_every_2s_mb=rss.samples)
        progress(
            f"  {name}: {_line(result)}; RSS {rss_before.rss_mb:.0f} -> {rss_after.rss_mb:.0f} MB"
            f"; cores {used}"
        )
        wait_idle(base_url(url), 60.0, 0.2)
        return result

    return phase


def ensure_open_files(need: int) -> None:
    """Raise this process's open-file limit (children inherit it): hey and the server each hold
    a socket per client."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SystemExit(
            f"the open-file limit is {hard} (hard); this run needs {need}: raise it "
            "(`ulimit -Hn`, /etc/security/limits.conf) or lower --clients"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _record(
    name: str, result: HeyResult, before: Samples, after: Samples, rss_before: float, proc: Any
) -> dict[str, Any]:
    server_counts = {
        key.split('"')[1]: delta(after, before, key)
        for key in after
        if key.startswith(_LATENCY_COUNT + "{")
    }
    batches, rows = batches_and_rows(after, before)

    def mean_ms(total: str, count: str | float) -> float | None:
        n = delta(after, before, count) if isinstance(count, str) else count
        return 1000.0 * delta(after, before, total) / n if n else None

    stage = '{replica="0",stage="0"}'
    return {
        "phase": name,
        **result.to_json(),
        "good_per_s": result.per_s(200),
        "answered_per_s": result.per_s(),
        "reject_per_s": result.per_s(503),
        "reject_p99_ms": result.p99_ms(503),
        "good_p99_ms": result.p99_ms(200),
        "server_statuses": {k: v for k, v in sorted(server_counts.items()) if v},
        "mean_batch_rows": rows / batches if batches else 0.0,
        # A batch's time through the pipeline as the server sees it, against the shard actor's
        # own compute: the gap is the hop and the front end's event loop.
        "mean_batch_run_ms": mean_ms("shardserve_batch_run_seconds_sum", batches),
        "mean_stage_compute_ms": mean_ms(
            f"shardserve_stage_compute_seconds_total{stage}", f"shardserve_stage_calls_total{stage}"
        ),
        "mean_queue_wait_ms": mean_ms("shardserve_queue_wait_seconds_sum", batches),
        "rss_before_mb": rss_before,
        "rss_after_mb": proc.rss_mb,
        "peak_rss_mb": proc.peak_rss_mb,
    }


def _line(result: HeyResult) -> str:
    parts = [f"{result.per_s(200):,.0f} good/s"]
    for status, stats in sorted(result.statuses.items()):
        parts.append(f"{status}: {stats.count} (p99 {stats.p99_ms:.1f} ms)")
    return ", ".join(parts)


def render(results: dict[str, Any]) -> str:
    """The phases side by side, then the targets, as Markdown."""
    if "access_log" in results:
        return _render_access_log(results)
    capacity = results["capacity"]
    lines = [
        "| phase | clients | per-client rate | offered (answered) req/s | good req/s | / C "
        "| 503/s | 503 p99 ms | 200 p99 ms | mean batch rows | front-end RSS MB |",
        "|" + "---|" * 11,
    ]
    for p in results["phases"]:
        rate = f"{p['rate_per_client']:g}/s" if p["rate_per_client"] else "none"
        lines.append(
            f"| {p['phase']} | {p['clients']:,} | {rate} | {p['answered_per_s']:,.0f} "
            f"| {p['good_per_s']:,.0f} | {p['goodput_ratio']:.2f}x | {p['reject_per_s']:,.0f} "
            f"| {_ms(p['reject_p99_ms'])} | {_ms(p['good_p99_ms'])} | {p['mean_batch_rows']:.1f} "
            f"| {p['rss_before_mb']:.0f} -> {p['rss_after_mb']:.0f} |"
        )
    over = next(p for p in results["phases"] if p["phase"] == "overload")
    growth = over["rss_after_mb"] - over["rss_before_mb"]
    reject_p99 = over["reject_p99_ms"]
    checks = [
        (
            f"goodput at {results['plan']['factor']:g}C >= {GOODPUT_TARGET}x C",
            f"{over['goodput_ratio']:.2f}x ({over['good_per_s']:,.0f} of {capacity:,.0f} req/s)",
            over["goodput_ratio"] >= GOODPUT_TARGET,
        ),
        (
            f"503 p99 <= {REJECT_P99_TARGET_MS:g} ms",
            f"{_ms(reject_p99)} ms",
            reject_p99 is not None and reject_p99 <= REJECT_P99_TARGET_MS,
        ),
        (
            f"front-end RSS growth < {RSS_GROWTH_TARGET_MB:g} MB",
            f"{growth:+.0f} MB",
            growth < RSS_GROWTH_TARGET_MB,
        ),
    ]
    lines += [
        "",
        "| phase | sent in the busiest tenth of a tick | 503s on a new connection "
        "| their connect p99 ms | batch ms: in the server | in the actor | cores: front end "
        "| shard actor | rest of Ray | hey | anything else on the machine |",
        "|" + "---|" * 11,
    ]
    for p in results["phases"]:
        rejected = p["statuses"].get("503")
        used = p.get("cores", {})
        conn = (
            f"{rejected['new_connection_share']:.0%} | {rejected['connect_p99_ms']:,.1f}"
            if rejected
            else "- | -"
        )
        lines.append(
            f"| {p['phase']} | {_share(p.get('burst_share'))} | {conn} "
            f"| {_ms(p.get('mean_batch_run_ms'))} "
            f"| {_ms(p.get('mean_stage_compute_ms'))} | "
            + " | ".join(
                f"{used.get(k, 0.0):.2f}"
                for k in ("frontend", "shard_actors", "ray_other", "load_generator", "others")
            )
            + " |"
        )
    lines += ["", "| target (overload phase) | measured | verdict |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {'met' if ok else '**missed**'} |" for t, m, ok in checks]
    return "\n".join(lines) + "\n"


def _render_access_log(results: dict[str, Any]) -> str:
    """``--access-log``'s run: its phases, then each form's goodput against the log off."""
    capacity = results["capacity"]
    summary = results["access_log"]
    base = summary["baseline"]
    lines = [
        f"C = {capacity:,.0f} req/s (on the server with the access log {base}); each overload "
        f"phase offers {results['plan']['factor']:g}C.",
        "",
        "| phase | round | offered (answered) req/s | good req/s | / C | 503/s | 503 p99 ms "
        "| 200 p99 ms | front-end cores |",
        "|" + "---|" * 9,
    ]
    for p in results["phases"]:
        lines.append(
            f"| {p['phase']} | {p.get('round', '-')} | {p['answered_per_s']:,.0f} "
            f"| {p['good_per_s']:,.0f} | {p['goodput_ratio']:.2f}x | {p['reject_per_s']:,.0f} "
            f"| {_ms(p['reject_p99_ms'])} | {_ms(p['good_p99_ms'])} "
            f"| {p.get('cores', {}).get('frontend', 0.0):.2f} |"
        )
    lines += [
        "",
        f"| access log | good req/s per round | median | / {base} "
        f"| >= {ACCESS_LOG_TARGET:g}x {base} |",
        "|---|---|---|---|---|",
    ]
    for form, goods in summary["good_per_s"].items():
        ratio = summary["ratio"][form]
        verdict = (
            "-"
            if form == base
            else ("met" if ratio is not None and ratio >= ACCESS_LOG_TARGET else "**missed**")
        )
        lines.append(
            f"| {form} | {', '.join(f'{g:,.0f}' for g in goods)} "
            f"| {summary['median_good_per_s'][form]:,.0f} "
            f"| {'-' if ratio is None else f'{ratio:.3f}'} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def add_parsers(sub: Any) -> None:
    about = "goodput and 503s at 3x capacity (needs hey)"
    out = "docs/bench-faults"
    opts = options.suite(
        sub, "overload", about, out=out, plan=OverloadPlan, run=run_overload, render=render
    )
    opts.add("workload", "max_batch_size", "batch_timeout_ms", "warmup_s")
    opts.add("capacity_clients", "capacity_s")
    opts.own("--factor", type=float)
    opts.add("clients")
    opts.add("seconds", dest="overload_s", help="of each overload phase")
    opts.own("--staggered-groups", type=int, help="0: no staggered phase")
    opts.own("--retry-seconds", dest="retry_s", type=float)
    opts.add("port", "workdir")
    opts.own(
        "--access-log",
        type=options.csv,
        help="instead of the phases above: one server per access-log form (off,json), "
        "overload goodput side by side",
    )
    opts.own("--log-rounds", type=int, help="overload phases per access-log form")
