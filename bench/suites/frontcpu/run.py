"""``python -m bench frontcpu``: the front end's CPU per request, this code tree against another
(issue 18: at most 5% more after the move into packages).

Per workload (``light`` and ``heavy`` of ``bench.models.workloads``, served as ``bench
protocols`` serves them: 1 stage, max batch 64, 5 ms timeout), one shardserve server per code
tree, side by side: this checkout (``--tree``, "new") and ``--compare-tree DIR`` ("old", a ``git
worktree`` of an older commit); a workload's pair stops before the next one starts. Each window is
a closed loop of ``--clients`` on one protocol (wrk on TF-Serving JSON ``/predict`` and V2 binary
tensors, ``loadtest.bodies``' bodies; V2 gRPC ``ModelInfer`` serialized once and sent as bytes
by ``bench.load.grpcload --raw``, so that the client spends its CPU on gRPC alone) against one
server, and its CPU per request is ``bench protocols``' figure: the server process's utime + stime (uvicorn, the batcher, Ray's driver side;
not the shard actors) over the answers the server counted in the window.

The windows alternate: in each of ``--rounds`` rounds, per protocol, old then new, the order
flipped every round, so that a drift of the machine falls on both trees alike. With ``--pin`` the
servers and their Ray run on the first core, wrk on the second (``bench looplag``'s pinning).

``--tracing off,1.0,0.01`` (issue 30) measures this tree's tracing modes side by side instead of
two trees, one server per mode: ``off``, or on at a sampling ratio (``OTEL_TRACES_SAMPLER=
parentbased_traceidratio``, ``OTEL_TRACES_SAMPLER_ARG``: the ratio; the load sends no
``traceparent``, so the ratio decides), exporting over OTLP/HTTP to a sink in this process that
accepts and drops every post (``bench.observe.otlp_sink``): the cost measured is the server's
spans and their export, not a collector's. Each mode's CPU per request, and its ratio to ``off``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench import options
from bench.load import grpcload
from bench.load.loops import WRK_INSTALL_HINT, closed_loop, have_wrk
from bench.load.result import LoadResult
from bench.models.workloads import get_workload, save_workload
from bench.observe.otlp_sink import OtlpSink
from bench.observe.scrape import free_port, wait_idle
from bench.options import Progress
from bench.suites.frontcpu.report import TREES, render, summarize, summarize_modes
from bench.suites.looplag import cli_module, describe_tree, pin_argv, pinned, resolved
from bench.suites.protocols.check import check_answers
from bench.suites.protocols.run import (
    HTTP_PROTOCOLS,
    PROTOCOLS,
    ProtocolsPlan,
    clients_by_workload,
    get_json,
    measure_window,
)
from bench.systems.base import REPO_ROOT, LaunchSpec, ServerProcess, SystemConfig
from bench.systems.shardserve import shardserve_spec
from loadtest.bodies import encode_body, random_inputs, request_path

Bodies = dict[str, tuple[bytes, dict[str, str]]]


@dataclass(frozen=True)
class FrontCpuPlan:
    workloads: tuple[str, ...] = ("light", "heavy")
    protocols: tuple[str, ...] = ("tfserving", "v2-binary", "grpc")
    clients: dict[str, int] = field(default_factory=lambda: ProtocolsPlan().clients)
    rounds: int = 3
    window_s: float = 6.0  # wrk counts whole seconds
    warmup_s: float = 2.0  # per tree and protocol, before the first window
    max_batch_size: int = ProtocolsPlan.max_batch_size
    batch_timeout_ms: float = ProtocolsPlan.batch_timeout_ms
    tree: Path = REPO_ROOT
    compare_tree: Path | None = None
    pin: bool = len(os.sched_getaffinity(0)) >= 2
    workdir: Path = Path(".bench/frontcpu")
    # This tree's tracing modes instead of two trees: "off", or a sampling ratio in (0, 1].
    tracing: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for workload in self.workloads:
            get_workload(workload)
            if self.clients.get(workload, 0) < 1:
                raise ValueError(f"no --clients count (>= 1) for workload {workload!r}")
        unknown = set(self.protocols) - set(PROTOCOLS)
        if unknown or not self.protocols:
            raise ValueError(f"protocols must be among {PROTOCOLS}, got {self.protocols}")
        options.require(self, at_least_one=("rounds",), positive=("window_s", "warmup_s"))
        for tree in (self.tree, self.compare_tree):
            if tree is not None:
                cli_module(tree)
        for mode in self.tracing:
            sampling_ratio(mode)
        if len(set(self.tracing)) != len(self.tracing):
            raise ValueError(f"each tracing mode once, got {self.tracing}")


def sampling_ratio(mode: str) -> float | None:
    """A ``--tracing`` mode's sampling ratio: ``None`` for ``off``, else a float in (0, 1]."""
    if mode == "off":
        return None
    try:
        ratio = float(mode)
    except ValueError:
        ratio = -1.0
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"a tracing mode is 'off' or a sampling ratio in (0, 1], got {mode!r}")
    return ratio


def mode_label(mode: str) -> str:
    """A tracing mode's name in the results (and its server's log file): off, on-1, on-0.01."""
    ratio = sampling_ratio(mode)
    return "off" if ratio is None else f"on-{ratio:g}"


def tracing_env(mode: str, endpoint: str) -> dict[str, str]:
    """The server's OpenTelemetry variables for ``mode`` (its stage actors inherit them):
    ``off`` disables the SDK, so that no OTEL_* variable of the bench's own environment can
    turn tracing on; a ratio exports everything sampled to ``endpoint`` over OTLP/HTTP."""
    ratio = sampling_ratio(mode)
    if ratio is None:
        return {"OTEL_SDK_DISABLED": "true"}
    return {
        "OTEL_SDK_DISABLED": "false",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint + "/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": f"{ratio:g}",
    }


def have_otlp_http() -> bool:
    """Whether the OTLP/HTTP exporter (``pip install 'shardserve[tracing]'``) is installed."""
    try:
        found = importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http")
    except ModuleNotFoundError:
        return False
    return found is not None


def has_grpc(tree: Path) -> bool:
    """Whether ``tree``'s server takes ``--grpc-port`` (its settings declare ``grpc_port``)."""
    return any("grpc_port" in path.read_text() for path in (tree / "serving").rglob("*.py"))


def schedule(
    rounds: int, protocols: tuple[str, ...], labels: tuple[str, ...] = TREES
) -> list[tuple[int, str, str]]:
    """(round, protocol, server) in the order run: old then new in even rounds, new then old in
    odd ones, so that neither tree always follows the other's load (``labels``: the servers,
    tracing modes for ``--tracing``)."""
    out = []
    for round_ in range(rounds):
        order = labels if round_ % 2 == 0 else labels[::-1]
        out += [(round_, protocol, tree) for protocol in protocols for tree in order]
    return out


def run(plan: FrontCpuPlan, progress: Progress = options.say) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        sink: OtlpSink | None = None
        if plan.tracing:
            if plan.compare_tree is not None:
                raise ValueError("--tracing measures this tree's modes: leave out --compare-tree")
            if any(sampling_ratio(m) is not None for m in plan.tracing) and not have_otlp_http():
                raise SystemExit(
                    "bench frontcpu --tracing exports over OTLP/HTTP: pip install -e '.[tracing]'"
                )
            sink = stack.enter_context(OtlpSink())
            progress(f"[frontcpu] OTLP sink (accepts and drops) at {sink.endpoint}")
            sides = {
                mode_label(m): (plan.tree, tracing_env(m, sink.endpoint)) for m in plan.tracing
            }
        elif plan.compare_tree is None:
            raise ValueError(
                "frontcpu compares two code trees (--compare-tree) or this tree's tracing modes "
                "(--tracing off,1.0,0.01)"
            )
        else:
            sides = {"old": (plan.compare_tree, {}), "new": (plan.tree, {})}
        results = _run(plan, sides, progress)
        if sink is not None:
            results["sink"] = {"posts": sink.posts, "bytes": sink.bytes}
            progress(f"[frontcpu] the sink took {sink.posts} posts ({sink.bytes:,} bytes)")
    return results


def _run(
    plan: FrontCpuPlan, sides: dict[str, tuple[Path, dict[str, str]]], progress: Progress
) -> dict[str, Any]:
    trees = {label: tree for label, (tree, _) in sides.items()}
    without = sorted({str(tree) for tree in trees.values() if not has_grpc(tree)})
    if "grpc" in plan.protocols and without:
        progress(f"[frontcpu] no gRPC in {', '.join(without)} (no --grpc-port): grpc left out")
        plan = replace(plan, protocols=tuple(p for p in plan.protocols if p != "grpc"))
        if not plan.protocols:
            raise SystemExit("bench frontcpu: no protocol left to measure")
    if not have_wrk() and set(plan.protocols) & set(HTTP_PROTOCOLS):
        raise SystemExit(f"bench frontcpu drives wrk; {WRK_INSTALL_HINT}")
    results: dict[str, Any] = {
        "plan": options.plan_json(plan),
        "trees": {label: describe_tree(tree) for label, tree in trees.items()},
        "windows": [],
    }
    for workload in plan.workloads:
        results["windows"] += measure_workload(plan, workload, sides, progress)
    if plan.tracing:
        results["modes"] = summarize_modes(results["windows"], tuple(sides))
        for cell in results["modes"]:
            progress(
                f"[frontcpu] {cell['workload']} {cell['protocol']}: ms CPU/req (median) "
                + ", ".join(
                    f"{m}: {_num(cell['median_ms'][m])} ({_num(cell['ratio'][m], 3)}x)"
                    for m in sides
                )
            )
        return results
    results["summary"] = summarize(results["windows"])
    for cell in results["summary"]:
        ratio = cell["ratio"]
        progress(
            f"[frontcpu] {cell['workload']} {cell['protocol']}: new/old of medians "
            f"{'n/a' if ratio is None else f'{ratio:.3f}'}"
        )
    return results


def _num(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def measure_workload(
    plan: FrontCpuPlan,
    workload: str,
    sides: dict[str, tuple[Path, dict[str, str]]],
    progress: Progress,
) -> list[dict[str, Any]]:
    """Every server of one workload up at once (``sides``: label -> its code tree and its extra
    environment), then the windows of ``schedule``."""
    workdir = plan.workdir.resolve()  # the servers run in their own trees' folders
    model = save_workload(workload, workdir)
    servers: dict[str, ServerProcess] = {}
    grpc_urls: dict[str, str] = {}
    windows = []
    with contextlib.ExitStack() as stack:
        for label, (tree, env) in sides.items():
            # Picked after the previous server holds its port, so the two never get the same one.
            port = free_port()
            grpc_port = free_port() if "grpc" in plan.protocols else 0
            spec = server_spec(plan, model, tree, label, port, grpc_port, env)
            grpc_urls[label] = f"127.0.0.1:{grpc_port}"
            log = workdir / "logs" / f"{workload}-{label}.log"
            progress(f"[frontcpu] {workload}: starting {label} ({tree}); log: {log}")
            body = get_workload(workload).request_body()
            servers[label] = stack.enter_context(ServerProcess(spec, port, body, log))
        bases = {label: server.url.rsplit("/", 1)[0] for label, server in servers.items()}
        name, bodies, inputs = request_bodies(bases)
        inputs_file = workdir / f"frontcpu-{workload}-inputs.npz"
        np.savez(inputs_file, **inputs)  # type: ignore[arg-type]
        stack.enter_context(pinned(plan.pin))

        def load(label: str, protocol: str, seconds: float) -> LoadResult:
            clients = plan.clients[workload]
            if protocol == "grpc":
                url = grpc_urls[label]
                return grpcload.run(url, name, inputs_file, clients, seconds, raw=True)
            body, headers = bodies[protocol]
            url = bases[label] + request_path(protocol, name)
            return closed_loop(url, body, clients, seconds, tool="wrk", headers=headers)

        for label in sides:
            for protocol in plan.protocols:
                load(label, protocol, plan.warmup_s)
            wait_idle(bases[label], 30.0, 0.05)
        for round_, protocol, label in schedule(plan.rounds, plan.protocols, tuple(sides)):
            before = os.getloadavg()[0]
            window = partial(load, label, protocol, plan.window_s)
            record = measure_window(servers[label].pid, bases[label], window)
            loadavg = [round(before, 2), round(os.getloadavg()[0], 2)]
            record.update(
                workload=workload, protocol=protocol, round=round_, tree=label, loadavg=loadavg
            )
            progress(
                f"  round {round_} {workload} {protocol:>9} {label}: "
                f"{record['cpu_ms_per_request']:.4f} ms CPU/req, {record['rps']:,.0f} req/s, "
                f"errors {record['errors']}, load avg {loadavg[0]:.2f} -> {loadavg[1]:.2f}"
            )
            windows.append(record)
    return windows


def server_spec(
    plan: FrontCpuPlan,
    model: Path,
    tree: Path,
    label: str,
    port: int,
    grpc_port: int = 0,
    env: dict[str, str] | None = None,
) -> LaunchSpec:
    """``bench protocols``' server (gRPC on ``grpc_port``; 0: none), run from ``tree``'s own CLI
    module: the venv's ``shardserve`` script imports this checkout's, and the old tree's lives
    elsewhere; ``env``: more of its environment (a tracing mode's variables)."""
    config = SystemConfig(model, port, plan.max_batch_size, plan.batch_timeout_ms)
    cache = plan.workdir.resolve() / f"cache-{label}"  # the trees may partition differently
    served = shardserve_spec(config, 1, cache, flags={"--grpc-port": str(grpc_port)}).argv[1:]
    argv = [*pin_argv(plan.pin), sys.executable, "-m", cli_module(tree), *served]
    # The tree's own packages first, in the server and (through the working directory, which a
    # local Ray puts on its workers' path) in its shard actors.
    return LaunchSpec(
        f"shardserve@{label}", argv, env={**(env or {}), "PYTHONPATH": str(tree)}, cwd=tree
    )


def request_bodies(bases: dict[str, str]) -> tuple[str, Bodies, dict[str, np.ndarray]]:
    """One body per HTTP protocol for the served model, checked on every server: each protocol's
    answers agree, and every server serves the model under the same name; and the inputs they
    hold (gRPC's request is built from them)."""
    names = {label: get_json(f"{base}/readyz")["model"] for label, base in bases.items()}
    if len(set(names.values())) != 1:
        raise RuntimeError(f"the servers serve the model under different names: {names}")
    name = names[next(reversed(names))]  # the last: "new" of two trees
    metadata = get_json(f"{bases[next(reversed(bases))]}/v1/models/{name}/metadata")
    inputs = random_inputs(metadata, 1, np.random.default_rng(0))
    bodies = {p: encode_body(inputs, p) for p in HTTP_PROTOCOLS}
    for base in bases.values():
        check_answers(base, name, bodies)
    return name, bodies, inputs


def add_parsers(sub: Any) -> None:
    about = (
        "front-end CPU per request, this tree against --compare-tree, or this tree's tracing "
        "modes (--tracing off,1.0,0.01); needs wrk for HTTP"
    )
    opts = options.suite(
        sub, "frontcpu", about, out="docs/bench-frontcpu", plan=FrontCpuPlan, run=run, render=render
    )
    opts.add("workloads")
    opts.own("--protocols", type=options.csv, help="comma-separated: " + ",".join(PROTOCOLS))
    opts.add("clients", type=clients_by_workload, help="heavy=256,light=64")
    opts.own("--rounds", type=int, help="old and new windows per round, the order flipped each")
    opts.own("--window-s", type=float, help="seconds of wrk per window (whole seconds)")
    opts.add("warmup_s", "max_batch_size", "batch_timeout_ms")
    opts.own("--tree", type=resolved, help="code tree measured as 'new'")
    opts.own("--compare-tree", type=resolved, help="code tree measured as 'old'")
    opts.own(
        "--tracing",
        type=options.csv,
        help="instead of two trees: this tree's tracing modes, 'off' or a sampling ratio "
        "(off,1.0,0.01), exported to a sink that drops them",
    )
    opts.add("pin", "workdir")
