"""``python -m bench looplag``: how long a 1-row request waits on an event loop busy with big
JSON bodies (issue 17, item 13).

One shardserve server per code tree: this checkout (``--tree``) and, with ``--compare-tree DIR``,
another (a ``git worktree`` of an older commit). Both are started once, then measured in turn,
A B A B A B over ``--rounds`` rounds, each turn two phases of ``--seconds``:

1. **alone**: a 1-row predict every ``--probe-every-ms``, open loop (the probe: each is sent
   when due and timed from then, so that a stall shows in every probe it delays, and a p99 has
   enough probes behind it even when each takes a second);
2. **loaded**: the same probe while ``--clients`` clients each POST a ``--big-bytes`` JSON body
   of the model's rows, back to back. Both are ``bench.load.pyload``.

The stages sleep ``--simulate-device-ms`` per batch instead of computing, so the probe's latency
is the front end's: reading, decoding, batching, shipping and encoding the big bodies, and what
they hold the GIL for. With ``--pin`` (the default with 2+ cores) the servers and their Ray run
on the first core, the probe and the load on the second. Reported: the probe's p50/p99 per
phase and turn, and the ratio of the loaded p99 of this tree to the compared one's.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench import options
from bench.load.result import start_child, wait_child
from bench.observe.scrape import free_port
from bench.options import Progress
from bench.systems.base import REPO_ROOT, LaunchSpec, ServerProcess

MiB = 2**20
# The demo models the bench knows the input width of (the body is made before the server runs).
FEATURES = {"demo-tiny": 8, "demo-mlp": 1024}


@dataclass(frozen=True)
class LoopLagPlan:
    model: str = "demo-mlp"
    big_bytes: int = 16 * MiB
    clients: int = 4
    seconds: float = 15.0
    probe_every_ms: float = 20.0
    ramp_s: float = 1.5  # the load generator's start-up, before the probe counts
    rounds: int = 3
    max_batch_size: int = 256
    simulate_device_ms: float = 1.0
    # Refused: the big bodies are read and parsed, then refused (one row more than
    # max_queue_rows), so the probe never queues behind their rows and sees the loop's stalls
    # alone. One row over, not far over: a body of many more arrays than the queue's rows could
    # hold is refused from its bytes before it is parsed (serving.protocols.limits).
    refuse_big: bool = False
    tree: Path = REPO_ROOT
    compare_tree: Path | None = None
    pin: bool = len(os.sched_getaffinity(0)) >= 2
    workdir: Path = Path(".bench/looplag")

    def __post_init__(self) -> None:
        if self.model not in FEATURES:
            raise ValueError(f"model {self.model!r}: looplag knows {sorted(FEATURES)}")
        options.require(
            self,
            at_least_one=("clients", "rounds"),
            positive=("seconds", "probe_every_ms", "big_bytes"),
        )
        for tree in (self.tree, self.compare_tree):
            if tree is not None:
                cli_module(tree)


def rows_body(features: int, rows: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    batch = np.round(rng.standard_normal((rows, features)).astype(np.float32), 4)
    return orjson.dumps({"instances": batch.tolist()})


def big_body(features: int, size: int) -> tuple[bytes, int]:
    """A row-form body of about ``size`` bytes (never more) and its row count."""
    per_row = len(rows_body(features, 64)) / 64
    rows = max(int(size / per_row), 1)
    body = rows_body(features, rows)
    while len(body) > size and rows > 1:
        rows = max(int(rows * size / len(body)) - 1, 1)
        body = rows_body(features, rows)
    return body, rows


def cli_module(tree: Path) -> str:
    """The module that runs ``shardserve`` in ``tree``: the compared tree may predate issue 18's
    move of ``serving/cli.py`` into ``serving/cli/``."""
    for module in ("serving.cli.main", "serving.cli"):
        if (tree / (module.replace(".", "/") + ".py")).is_file():
            return module
    raise ValueError(f"{tree} is not a shardserve code tree (no serving/cli/main.py)")


def server_spec(plan: LoopLagPlan, tree: Path, label: str, port: int, rows: int) -> LaunchSpec:
    argv = [
        *pin_argv(plan.pin),
        sys.executable,
        "-m",
        cli_module(tree),
        "serve",
        "--model",
        plan.model,
    ]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0"]
    argv += ["--stages", "1", "--max-batch-size", str(plan.max_batch_size)]
    argv += ["--batch-timeout-ms", "0", "--simulate-device-ms", f"{plan.simulate_device_ms:g}"]
    argv += ["--max-body-bytes", str(plan.big_bytes + MiB)]
    queue_rows = rows - 1 if plan.refuse_big else (plan.clients + 2) * rows
    argv += ["--max-queue-rows", str(queue_rows)]
    argv += ["--cache-dir", str((plan.workdir / f"cache-{label}").resolve()), "--log-level"]
    argv += ["warning"]
    # The tree's own packages first, in the server and (through the working directory, which a
    # local Ray puts on its workers' path) in its shard actors.
    return LaunchSpec(f"shardserve@{label}", argv, env={"PYTHONPATH": str(tree)}, cwd=tree)


def pyload(port: int, body_file: Path, *how: str) -> subprocess.Popen[bytes]:
    url = f"http://127.0.0.1:{port}/predict"
    return start_child("bench.load.pyload", ["--url", url, "--body", str(body_file), *how])


def result_of(load: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any]:
    result = wait_child(load, timeout_s).to_json()
    keys = ("requests", "rps", "p50_ms", "p90_ms", "p99_ms", "errors")
    return {k: round(result[k], 2) for k in keys}


def probe(plan: LoopLagPlan, port: int, probe_file: Path) -> dict[str, Any]:
    """A 1-row predict every ``probe_every_ms``, open loop: each is sent when due, whatever
    the ones before it got, and its latency counts from then (a stalled loop delays them all)."""
    rate = 1000.0 / plan.probe_every_ms
    load = pyload(port, probe_file, "--rate", f"{rate:g}", "--seconds", f"{plan.seconds:g}")
    return result_of(load, plan.seconds + 300)


def loaded_phase(
    plan: LoopLagPlan, port: int, probe_file: Path, body_file: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The probe while ``clients`` closed-loop clients send the big body."""
    seconds = f"{plan.ramp_s + plan.seconds:g}"
    load = pyload(port, body_file, "--concurrency", str(plan.clients), "--seconds", seconds)
    try:
        time.sleep(plan.ramp_s)  # the generator imports and connects; its first bodies go out
        result = probe(plan, port, probe_file)
    except BaseException:
        load.kill()
        raise
    return result, result_of(load, plan.seconds + 300)


def run(plan: LoopLagPlan, progress: Progress = print) -> dict[str, Any]:
    plan.workdir.mkdir(parents=True, exist_ok=True)
    features = FEATURES[plan.model]
    probe_body = rows_body(features, 1)
    probe_file = plan.workdir / "probe-body.json"
    probe_file.write_bytes(probe_body)
    body, rows = big_body(features, plan.big_bytes)
    if plan.refuse_big and rows <= plan.max_batch_size:
        raise ValueError(
            f"--refuse-big needs bodies of more rows than --max-batch-size ({plan.max_batch_size}),"
            f" got {rows}: raise --big-bytes or lower --max-batch-size"
        )
    body_file = plan.workdir / "big-body.json"
    body_file.write_bytes(body)
    progress(f"[looplag] big body: {len(body) / MiB:.2f} MiB, {rows} rows of {features}")
    trees = {"new": plan.tree}
    if plan.compare_tree is not None:
        trees["old"] = plan.compare_tree
    results: dict[str, Any] = {
        "plan": options.plan_json(plan),
        "big_body": {"bytes": len(body), "rows": rows},
        "trees": {label: describe_tree(tree) for label, tree in trees.items()},
        "turns": [],
    }
    with contextlib.ExitStack() as stack:
        servers: dict[str, ServerProcess] = {}
        ports: dict[str, int] = {}
        for label, tree in trees.items():
            ports[label] = free_port()
            spec = server_spec(plan, tree, label, ports[label], rows)
            log = (plan.workdir / f"server-{label}.log").resolve()
            progress(f"[looplag] starting {label} ({tree}); log: {log}")
            servers[label] = stack.enter_context(ServerProcess(spec, ports[label], probe_body, log))
        stack.enter_context(pinned(plan.pin))
        for round_ in range(plan.rounds):
            # A B, then B A: neither tree always goes first after the other's load.
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for label in order:
                turn = measure_turn(plan, ports[label], probe_file, body_file)
                turn.update(round=round_, tree=label)
                results["turns"].append(turn)
                progress(f"  round {round_} {label}: {_turn_line(turn)}")
    results["summary"] = summarize(results["turns"])
    if "ratio" in results["summary"]:
        progress(f"[looplag] loaded p99 new/old: {results['summary']['ratio']:.2f}")
    return results


def measure_turn(plan: LoopLagPlan, port: int, probe_file: Path, body_file: Path) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    alone = probe(plan, port, probe_file)
    loaded, big = loaded_phase(plan, port, probe_file, body_file)
    return {
        "alone": alone,
        "loaded": loaded,
        "big": big,
        "loadavg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def summarize(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Per tree the median over rounds; with two trees the ratio new/old of the loaded p99's
    medians and the same ratio per round (each round's turns ran next to each other)."""
    out: dict[str, Any] = {"trees": {}}
    by_tree: dict[str, list[dict[str, Any]]] = {}
    for turn in turns:
        by_tree.setdefault(turn["tree"], []).append(turn)
    for label, mine in by_tree.items():
        out["trees"][label] = {
            f"{phase}_{stat}": statistics.median(t[phase][stat] for t in mine)
            for phase in ("alone", "loaded")
            for stat in ("p50_ms", "p99_ms")
        }
    if {"new", "old"} <= set(by_tree):
        new, old = out["trees"]["new"], out["trees"]["old"]
        out["ratio"] = round(new["loaded_p99_ms"] / old["loaded_p99_ms"], 3)
        pairs = zip(by_tree["new"], by_tree["old"], strict=False)
        out["ratio_per_round"] = [
            round(n["loaded"]["p99_ms"] / o["loaded"]["p99_ms"], 3) for n, o in pairs
        ]
    return out


def describe_tree(tree: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else "?"

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"path": str(tree), "commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(dirty)}


def render(results: dict[str, Any]) -> str:
    big = results["big_body"]
    trees = ", ".join(
        f"{label} = {t['commit']}{' + local edits' if t['dirty'] else ''}"
        for label, t in results["trees"].items()
    )
    lines = [
        f"{results['plan']['clients']} clients x {big['bytes'] / MiB:.1f} MiB bodies "
        f"({big['rows']} rows of {results['plan']['model']}"
        f"{', refused after decoding' if results['plan']['refuse_big'] else ''}); trees: {trees}",
        "",
        "| round | tree | alone p50 ms | alone p99 ms | loaded p50 ms | loaded p99 ms | "
        "loaded p90 ms | big bodies done (not 200) | probe errors | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in results["turns"]:
        a, b = t["alone"], t["loaded"]
        lines.append(
            f"| {t['round']} | {t['tree']} | {a['p50_ms']:.1f} | {a['p99_ms']:.1f} | "
            f"{b['p50_ms']:.1f} | {b['p99_ms']:.1f} | {b['p90_ms']:.1f} | "
            f"{t['big']['requests']:.0f} ({t['big']['errors']:.0f}) | {a['errors'] + b['errors']} | "
            f"{t['loadavg'][0]:.2f} -> {t['loadavg'][1]:.2f} |"
        )
    summary = results["summary"]
    lines.append("")
    for label, s in summary["trees"].items():
        lines.append(
            f"- {label}, medians over rounds: alone p99 {s['alone_p99_ms']:.1f} ms, "
            f"loaded p99 {s['loaded_p99_ms']:.1f} ms"
        )
    if "ratio" in summary:
        per_round = ", ".join(f"{r:.2f}" for r in summary["ratio_per_round"])
        lines.append(f"- loaded p99 new/old: {summary['ratio']:.2f} (per round {per_round})")
    return "\n".join(lines) + "\n"


def _turn_line(turn: dict[str, Any]) -> str:
    a, b, big = turn["alone"], turn["loaded"], turn["big"]
    return (
        f"alone p50 {a['p50_ms']:.1f} p99 {a['p99_ms']:.1f} ms; loaded p50 {b['p50_ms']:.1f} "
        f"p99 {b['p99_ms']:.1f} ms ({b['requests']} probes, {big['rps']:.2f} big/s, "
        f"{big['errors']} big errors); load {turn['loadavg']}"
    )


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pin_argv(pin: bool) -> list[str]:
    """The command prefix that runs a server (and the Ray it starts) on the first core."""
    return ["taskset", "-c", str(_cores()[0])] if pin else []


@contextlib.contextmanager
def pinned(pin: bool) -> Iterator[None]:
    """The probe (this process) and the load generator (its child) on the second core."""
    if not pin:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {_cores()[1]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def add_parsers(sub: Any) -> None:
    about = "a 1-row request's p99 beside 16 MiB JSON bodies"
    opts = options.suite(
        sub, "looplag", about, out="docs/bench-looplag", plan=LoopLagPlan, run=run, render=render
    )
    opts.add("model", choices=sorted(FEATURES))
    opts.own("--big-bytes", type=int)
    opts.add("clients")
    opts.add("seconds", help="per phase")
    opts.own("--probe-every-ms", type=float)
    opts.own("--ramp", dest="ramp_s", type=float)
    opts.own("--rounds", type=int)
    opts.add("max_batch_size", "simulate_device_ms")
    opts.own("--tree", type=resolved, help="code tree measured as 'new'")
    opts.own("--compare-tree", type=resolved, help="code tree measured as 'old'")
    refuse = "parse the big bodies, then refuse them (400): the probe never queues behind them"
    opts.own("--refuse-big", action="store_true", help=refuse)
    opts.add("pin", "workdir")


def resolved(text: str) -> Path:
    return Path(text).resolve()
