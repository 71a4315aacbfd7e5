"""``python -m bench protocols``: TF-Serving JSON, V2 JSON, V2 binary, V2 gRPC and TF Serving
gRPC in one run.

Per workload, one shardserve server (1 stage, max batch 64) serving HTTP and gRPC, and the
model's own ceiling (direct calls at batch 64, ``bench.systems.ceiling``) measured before the
server starts and after it stops. Each protocol runs a closed loop against the same server, in
an order rotated per round: wrk for the HTTP routes (``POST /predict``; ``POST
/v2/models/{m}/infer`` with JSON, or with binary tensors and ``Inference-Header-Content-Length``;
the bodies are ``loadtest.bodies.encode_body``'s), ``bench.load.grpcload`` for gRPC:
``grpc`` through ``tritonclient.grpc.aio``; ``grpc-raw`` (V2's ``ModelInfer``) and
``tfserving-grpc`` (TF Serving's ``Predict``) each one request serialized once and sent as its
bytes on a bare channel, so that neither pays the client's protobuf work. TF Serving gRPC against
V2 gRPC and TF Serving REST on the heavy model, 3 alternating windows:
``python -m bench protocols --workloads heavy --protocols tfserving,grpc-raw,tfserving-grpc
--repeats 3``. Measured per protocol: req/s, p50/p99, and the front end's CPU per request: utime +
stime of the server process (uvicorn, the batcher, Ray's driver side; not the shard actors) from
``/proc/<pid>/stat``, over the requests the server itself counted as answered in that window.

Every answer of the one-off check must agree across the HTTP protocols before any load runs.
The load generators share the server's cores (2 on the reference machine), as in ``bench run``.
"""

from __future__ import annotations

import argparse
import os
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench import options
from bench.load import grpcload
from bench.load.loops import WRK_INSTALL_HINT, closed_loop, have_wrk
from bench.load.result import LoadResult
from bench.models.workloads import get_workload, save_workload
from bench.observe.cpusplit import (
    children_cpu,
    cores,
    cpu_seconds,
    machine_busy_seconds,
    per_work,
    process_cpu_seconds,
    self_cpu,
)
from bench.observe.quiet import (
    other_benches,
    others_now,
    wait_until_quiet,
)
from bench.observe.scrape import (
    Samples,
    batches_and_rows,
    free_port,
    mean_batch_rows,
    scrape,
    wait_idle,
)
from bench.options import Progress
from bench.suites.protocols.check import check_answers
from bench.suites.protocols.report import render
from bench.systems import ServerProcess, SystemConfig
from bench.systems.ceiling import measure_ceiling
from bench.systems.shardserve import shardserve_spec
from loadtest.bodies import encode_body, random_inputs, request_path

HTTP_PROTOCOLS = ("tfserving", "v2-json", "v2-binary")
GRPC_PROTOCOLS = ("grpc", "grpc-raw", "tfserving-grpc")
PROTOCOLS = (*HTTP_PROTOCOLS, *GRPC_PROTOCOLS)
_LATENCY_COUNT = "shardserve_request_latency_seconds_count"


@dataclass(frozen=True)
class ProtocolsPlan:
    workloads: tuple[str, ...] = ("heavy", "light")
    protocols: tuple[str, ...] = (*HTTP_PROTOCOLS, "grpc")
    clients: dict[str, int] = field(default_factory=lambda: {"heavy": 256, "light": 64})
    repeats: int = 2
    seconds: float = 10.0
    warmup_s: float = 2.0
    max_batch_size: int = 64
    batch_timeout_ms: float = 5.0
    ceiling_s: float = 5.0
    quiet_wait_s: float = 600.0  # wait this long at most for other benchmarks and load to end
    quiet_load: float = 1.5  # 1-minute load average counted as quiet
    # A window in which the rest of the machine (other people's work) used more than this many
    # cores is measured again, up to noise_retries times; the quietest attempt is kept.
    noise_cores: float = 0.15
    noise_retries: int = 2
    port: int = 0  # 0: a free port, chosen at start
    grpc_port: int = 0
    workdir: Path = Path(".bench")

    def __post_init__(self) -> None:
        for workload in self.workloads:
            get_workload(workload)
            if self.clients.get(workload, 0) < 1:
                raise ValueError(f"no --clients count (>= 1) for workload {workload!r}")
        unknown = set(self.protocols) - set(PROTOCOLS)
        if unknown or not self.protocols:
            raise ValueError(f"protocols must be among {PROTOCOLS}, got {self.protocols}")
        options.require(self, at_least_one=("repeats",), positive=("seconds",))
        if self.port and self.port == self.grpc_port:
            raise ValueError(f"port and grpc_port are both {self.port}")


def run_protocols(plan: ProtocolsPlan, progress: Progress = print) -> dict[str, Any]:
    port = plan.port or free_port()
    grpc_port = plan.grpc_port or next(p for p in iter(free_port, None) if p != port)
    plan = replace(plan, port=port, grpc_port=grpc_port)
    protocols = plan.protocols
    if not have_wrk() and set(protocols) & set(HTTP_PROTOCOLS):
        progress(f"note: wrk is missing, so only gRPC is measured; {WRK_INSTALL_HINT}")
        protocols = tuple(p for p in protocols if p in GRPC_PROTOCOLS)
        if not protocols:
            raise SystemExit(f"nothing to measure without wrk; {WRK_INSTALL_HINT}")
    results: dict[str, Any] = {
        "plan": options.plan_json(plan),
        "quiet": wait_until_quiet(plan.quiet_load, plan.quiet_wait_s, progress),
        "machine_cores": os.cpu_count(),
        "ceiling": {},
        "runs": [],
    }
    for workload in plan.workloads:
        model = save_workload(workload, plan.workdir)
        key = plan.max_batch_size
        before = _quiet_ceiling(plan, model)
        progress(f"[{workload}] ceiling at batch {key}: {before['rows_per_s']:,.0f} rows/s")
        results["runs"] += _measure(plan, protocols, workload, model, progress)
        after = _quiet_ceiling(plan, model)
        progress(f"[{workload}] ceiling after: {after['rows_per_s']:,.0f} rows/s")
        results["ceiling"][workload] = {
            "batch_size": plan.max_batch_size,
            "before_rows_per_s": before["rows_per_s"],
            "after_rows_per_s": after["rows_per_s"],
            "rows_per_s": (before["rows_per_s"] + after["rows_per_s"]) / 2,
            "cpu_ms_per_row": (before["cpu_ms_per_row"] + after["cpu_ms_per_row"]) / 2,
            "others_cores": [before["others_cores"], after["others_cores"]],
        }
    results["quiet_after"] = {"load_1min": os.getloadavg()[0], "other_benches": other_benches()}
    return results


def _measure(
    plan: ProtocolsPlan,
    protocols: tuple[str, ...],
    workload: str,
    model: Path,
    progress: Progress,
) -> list[dict[str, Any]]:
    config = SystemConfig(model, plan.port, plan.max_batch_size, plan.batch_timeout_ms)
    flags = {"--grpc-port": str(plan.grpc_port)}
    spec = shardserve_spec(config, 1, plan.workdir / "cache", flags=flags)
    log = plan.workdir / "logs" / f"protocols-{workload}.log"
    clients = plan.clients[workload]
    records = []
    progress(f"[{workload}] starting {spec.name} with gRPC on {plan.grpc_port} (log: {log})")
    with ServerProcess(spec, plan.port, get_workload(workload).request_body(), log) as server:
        base = server.url.rsplit("/", 1)[0]
        name = get_json(f"{base}/readyz")["model"]
        metadata = get_json(f"{base}/v1/models/{name}/metadata")
        inputs = random_inputs(metadata, 1, np.random.default_rng(0))
        bodies = {p: encode_body(inputs, p) for p in HTTP_PROTOCOLS}
        check_answers(base, name, bodies)
        inputs_file = plan.workdir / f"protocols-{workload}-inputs.npz"
        np.savez(inputs_file, **inputs)  # type: ignore[arg-type]

        def load(protocol: str, seconds: float) -> LoadResult:
            if protocol in GRPC_PROTOCOLS:
                return grpcload.run(
                    f"127.0.0.1:{plan.grpc_port}",
                    name,
                    inputs_file,
                    clients,
                    seconds,
                    raw=protocol == "grpc-raw",
                    tfserving=protocol == "tfserving-grpc",
                )
            body, headers = bodies[protocol]
            url = base + request_path(protocol, name)
            return closed_loop(url, body, clients, seconds, tool="wrk", headers=headers)

        # wrk runs at least 1 s: a warm-up of 0 is none at all (the smoke test's).
        for protocol in protocols if plan.warmup_s > 0 else ():
            load(protocol, plan.warmup_s)
        wait_idle(base, 30.0, 0.05)
        for repeat in range(plan.repeats):
            shift = repeat % len(protocols)
            for protocol in (*protocols[shift:], *protocols[:shift]):
                record = _quiet_window(
                    plan, server.pid, base, partial(load, protocol, plan.seconds)
                )
                record.update(workload=workload, protocol=protocol, repeat=repeat)
                progress(
                    f"  {workload} {protocol:>9}: {record['rps']:,.0f} req/s p50 "
                    f"{record['p50_ms']:.1f} ms p99 {record['p99_ms']:.1f} ms errors "
                    f"{record['errors']}; front end {record['cpu_ms_per_request']:.3f} ms CPU/req "
                    f"({record['frontend_cores']:.2f} cores), load generator "
                    f"{record['loadgen_cores']:.2f} cores, rest of machine "
                    f"{record['cores']['others']:.2f} cores (attempt {record['attempts']})"
                )
                records.append(record)
    return records


def _quiet_window(
    plan: ProtocolsPlan, pid: int, base: str, load: Callable[[], LoadResult]
) -> dict[str, Any]:
    """``measure_window``, after the rest of the machine has settled (at most a minute), and again while
    other work took more than ``noise_cores`` during it; the quietest attempt is kept.
    ``noise_retries`` 0: neither (one attempt, whatever the machine does)."""
    best: dict[str, Any] | None = None
    for attempt in range(plan.noise_retries + 1):
        deadline = time.monotonic() + 60.0
        while (
            plan.noise_retries
            and others_now(pid) > plan.noise_cores
            and time.monotonic() < deadline
        ):
            time.sleep(2.0)  # someone else's work; nothing to wait on but time
        record = measure_window(pid, base, load)
        record["attempts"] = attempt + 1
        if best is None or record["cores"]["others"] < best["cores"]["others"]:
            best = record
        if record["cores"]["others"] <= plan.noise_cores:
            break
    assert best is not None
    return best


def _quiet_ceiling(plan: ProtocolsPlan, model: Path) -> dict[str, float]:
    """The model's rows/s at the max batch size, measured again while other work took more
    than ``noise_cores`` during it (the quietest attempt is kept)."""
    best: dict[str, float] | None = None
    for _ in range(plan.noise_retries + 1):
        busy, mine, tick = machine_busy_seconds(), children_cpu() + self_cpu(), time.monotonic()
        ceiling = measure_ceiling(model, (plan.max_batch_size,), plan.ceiling_s)
        at_max = ceiling[str(plan.max_batch_size)]
        used = machine_busy_seconds() - busy - (children_cpu() + self_cpu() - mine)
        record = {
            "rows_per_s": at_max["rows_per_s"],
            "cpu_ms_per_row": at_max.get("cpu_ms_per_row", float("nan")),
            "others_cores": max(used, 0.0) / (time.monotonic() - tick),
        }
        if best is None or record["others_cores"] < best["others_cores"]:
            best = record
        if record["others_cores"] <= plan.noise_cores:
            break
    assert best is not None
    return best


def measure_window(pid: int, base: str, load: Callable[[], LoadResult]) -> dict[str, Any]:
    """One load window: the generator's figures, and the server's CPU and answers in it."""
    before, cpu, gen, tick = scrape(base), process_cpu_seconds(pid), children_cpu(), _now()
    split = cpu_seconds(pid)
    result = load()
    wait_idle(
        base, 30.0, 0.05
    )  # the answers still out when the generator stopped belong to this window
    elapsed = _now() - tick
    used = process_cpu_seconds(pid) - cpu
    parts = cores(split, cpu_seconds(pid), elapsed)
    after = scrape(base)
    served = _answered(after) - _answered(before)
    _, rows = batches_and_rows(after, before)
    return {
        **result.to_json(),
        "served": served,
        "mean_batch_rows": mean_batch_rows(after, before),
        # CPU per unit of work: the front end's and Ray's per request, the shard actor's per
        # row (against the model's own CPU per row at the max batch: the ceiling's), and the
        # share of the machine left idle.
        **per_work(parts, elapsed, served, rows, os.cpu_count() or 1),
        "frontend_cpu_s": used,
        "cpu_ms_per_request": 1000 * used / served if served else float("nan"),
        "frontend_cores": used / elapsed,
        "loadgen_cores": (children_cpu() - gen) / elapsed,
        # Cores per part over the window: front end, shard actor, rest of Ray, load generator,
        # and the rest of the machine (other people's work shows up there).
        "cores": parts,
    }


def _answered(samples: Samples) -> float:
    return sum(v for k, v in samples.items() if k.startswith(_LATENCY_COUNT + "{"))


def _now() -> float:
    return time.monotonic()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return orjson.loads(response.read())


def clients_by_workload(text: str) -> dict[str, int]:
    out = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, count = part.partition("=")
        if not sep or not count.isdigit():
            raise argparse.ArgumentTypeError(f"clients {part!r} must look like heavy=256")
        out[name] = int(count)
    return out


def add_parsers(sub: Any) -> None:
    about = "TF-Serving JSON vs V2 JSON, binary and gRPC, and TF Serving gRPC (needs wrk)"
    out = "docs/bench-protocols"
    opts = options.suite(
        sub, "protocols", about, out=out, plan=ProtocolsPlan, run=run_protocols, render=render
    )
    opts.add("workloads")
    opts.own("--protocols", type=options.csv)
    opts.add("clients", type=clients_by_workload, help="heavy=256,light=64")
    opts.add("repeats", "seconds", "warmup_s", "max_batch_size", "batch_timeout_ms")
    opts.add("ceiling_s")
    opts.own("--quiet-wait", dest="quiet_wait_s", type=float)
    opts.own("--quiet-load", type=float)
    opts.own("--noise-cores", type=float)
    opts.own("--noise-retries", type=int)
    opts.add("port")
    opts.own("--grpc-port", type=int)
    opts.add("workdir")
