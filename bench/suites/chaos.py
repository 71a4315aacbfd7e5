"""``python -m bench chaos``: faults under a steady load, and is every answer still right?

A small model with an Embedding (``bench.models.tokens``) served with 2 replicas and
``--shard-max-restarts 1`` on the server's own private Ray. For ``seconds`` at a fixed ``rate``
(open loop), 1% of the requests hold an id out of the Embedding's range, and every
``kill_every_s`` one shard actor is sent SIGKILL (``bench.load.chaos``). Each answer is compared
with the model's own output computed in a child of the bench: every good request must be
answered correctly (0 lost, 0 wrong), every poisoned one must get its own 422. Reported: the
counts, the latency during the run, and the replicas the server recovered or rebuilt.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench import options
from bench.load.chaos import Outcome, Traffic, drive
from bench.models.tokens import EXPECTED_FILE, MODEL_FILE, POISON_ID, ROW_LEN, VOCAB
from bench.observe.procinfo import read_proc
from bench.observe.scrape import Samples, base_url, delta, free_port, scrape
from bench.options import Progress
from bench.systems import ServerProcess, SystemConfig
from bench.systems.base import subprocess_env
from bench.systems.shardserve import shardserve_spec

MODEL_NAME = "tokens"
AFTER_KILL_S = 2.0  # requests due this soon after a kill are the ones a kill can slow down
_COUNTERS = (
    "shardserve_replica_recoveries_total",
    "shardserve_replica_rebuilds_total",
    "shardserve_poison_isolations_total",
)


@dataclass(frozen=True)
class ChaosPlan:
    seconds: float = 60.0
    rate: float = 100.0
    kill_every_s: float = 10.0
    poison_fraction: float = 0.01
    replicas: int = 2
    max_restarts: int = 1
    max_batch_size: int = 32
    batch_timeout_ms: float = 5.0
    request_timeout_s: float = 60.0
    recover_timeout_s: float = 180.0
    seed: int = 0
    port: int = 0  # 0: a free port, picked at start (other servers may run on this machine)
    workdir: Path = Path(".bench")

    def __post_init__(self) -> None:
        options.require(self, positive=("seconds", "rate", "kill_every_s", "request_timeout_s"))
        if not 0 <= self.poison_fraction < 1:
            raise ValueError(f"poison_fraction must be in [0, 1), got {self.poison_fraction}")
        # One replica is a valid plan: its requests wait for the killed actor's restart.
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")


def make_rows(plan: ChaosPlan) -> tuple[np.ndarray, np.ndarray]:
    """The token rows of every request, and which of them are poisoned (one id out of range)."""
    rng = np.random.default_rng(plan.seed)
    n = int(plan.rate * plan.seconds)
    rows = rng.integers(0, VOCAB, size=(n, ROW_LEN)).astype(np.int32)
    poisoned = np.zeros(n, dtype=bool)
    picks = rng.choice(n, size=round(n * plan.poison_fraction), replace=False)
    poisoned[picks] = True
    rows[picks, rng.integers(0, ROW_LEN, size=len(picks))] = POISON_ID
    return rows, poisoned


def run_chaos(plan: ChaosPlan, progress: Progress = print) -> dict[str, Any]:
    if os.environ.get("SHARDSERVE_RAY_ADDRESS"):
        # The victims are found among the server's descendants: its Ray must be its own.
        raise SystemExit(
            "unset SHARDSERVE_RAY_ADDRESS: the chaos bench's server starts its own Ray"
        )
    directory = plan.workdir / "chaos"
    directory.mkdir(parents=True, exist_ok=True)
    rows, poisoned = make_rows(plan)
    np.save(directory / "rows.npy", rows)
    _model_answers(directory)
    expected = np.load(directory / EXPECTED_FILE)
    model = directory / MODEL_FILE

    port = plan.port or free_port()
    config = SystemConfig(model, port, plan.max_batch_size, plan.batch_timeout_ms)
    flags = {
        "--cpus-per-shard": "1",
        "--replicas": str(plan.replicas),
        "--shard-max-restarts": str(plan.max_restarts),
        "--model-name": MODEL_NAME,
    }
    spec = shardserve_spec(config, 1, plan.workdir / "cache", flags=flags)
    spec = replace(spec, name=f"{spec.name}-x{plan.replicas}")
    ready_body = orjson.dumps({"instances": [[1, 2, 3, 4]]})
    log = plan.workdir / "logs" / "chaos.log"
    progress(f"[chaos] starting {spec.name} on {model} (log: {log})")
    with ServerProcess(spec, port, ready_body, log) as server:
        base = base_url(server.url)
        status_url = f"{base}/v1/models/{MODEL_NAME}"
        if _wait_healthy(status_url, plan.replicas, plan.recover_timeout_s) != plan.replicas:
            raise RuntimeError(f"{plan.replicas} replicas never became healthy; see {log}")
        before, proc_before = scrape(base), read_proc(server.pid)
        traffic = Traffic(
            url=server.url,
            status_url=status_url,
            server_pid=server.pid,
            bodies=[orjson.dumps({"instances": [row.tolist()]}) for row in rows],
            poisoned=poisoned,
            expected=expected,
            rate=plan.rate,
            kill_every_s=plan.kill_every_s,
            seconds=plan.seconds,
            request_timeout_s=plan.request_timeout_s,
            seed=plan.seed,
        )
        progress(f"  {len(rows)} requests at {plan.rate:g}/s, {int(poisoned.sum())} poisoned")
        tick = time.monotonic()
        outcomes, kills = asyncio.run(drive(traffic))
        _keep_outcomes(outcomes, plan.workdir / "logs" / "chaos-outcomes.csv")
        progress(f"  load done in {time.monotonic() - tick:.1f} s; kills: {kills}")
        healthy = _wait_healthy(status_url, plan.replicas, plan.recover_timeout_s)
        after, proc_after = scrape(base), read_proc(server.pid)
    results = summarize(plan, outcomes, kills, before, after, healthy)
    results["frontend"] = {"before": proc_before.to_json(), "after": proc_after.to_json()}
    return results


def summarize(
    plan: ChaosPlan,
    outcomes: list[Outcome],
    kills: list[dict[str, Any]],
    before: Samples,
    after: Samples,
    healthy_at_end: int | None,
) -> dict[str, Any]:
    verdicts = Counter(o.verdict for o in outcomes)
    good = [o for o in outcomes if not o.poisoned]
    kill_times = [k["t_s"] for k in kills if k["pid"] is not None]
    near = [o for o in good if any(0 <= o.due_s - t < AFTER_KILL_S for t in kill_times)]
    # The first poisoned answer can cost a one-time pause (the front end imports what it needs
    # to read the model's error); the requests due after it was answered show the steady state.
    first = next((o for o in outcomes if o.poisoned), None)
    settled = first.due_s + first.latency_ms / 1000.0 if first else 0.0
    return {
        "plan": options.plan_json(plan),
        "requests": len(outcomes),
        "poisoned": sum(o.poisoned for o in outcomes),
        "verdicts": {
            v: verdicts.get(v, 0) for v in ("ok", "wrong", "lost", "poison_422", "poison_wrong")
        },
        "statuses": {str(k): v for k, v in sorted(Counter(o.status for o in outcomes).items())},
        "latency_ms": _percentiles([o.latency_ms for o in good]),
        "latency_after_kill_ms": _percentiles([o.latency_ms for o in near]),
        "latency_after_first_poisoned_answer_ms": {
            "from_s": round(settled, 2),
            **_percentiles([o.latency_ms for o in good if o.due_s > settled]),
        },
        "poisoned_latency_ms": [
            [round(o.due_s, 2), round(o.latency_ms, 1)] for o in outcomes if o.poisoned
        ],
        "kills": kills,
        "good_latency_by_second": _by_second(good),
        "server": {name: delta(after, before, name) for name in _COUNTERS},
        "healthy_replicas_at_end": healthy_at_end,
        "failures": _samples_of_failures(outcomes),
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    p50, p99 = (float(v) for v in np.percentile(values, [50, 99]))
    return {"n": len(values), "p50": p50, "p99": p99, "max": float(max(values))}


def _samples_of_failures(outcomes: list[Outcome], per_kind: int = 3) -> list[dict[str, Any]]:
    """The first few failures of each kind (verdict and status), every kind shown."""
    seen: Counter[tuple[str, int]] = Counter()
    out = []
    for o in outcomes:
        if o.verdict in ("ok", "poison_422"):
            continue
        seen[(o.verdict, o.status)] += 1
        if seen[(o.verdict, o.status)] <= per_kind:
            out.append(asdict(o))
    return out


def _keep_outcomes(outcomes: list[Outcome], path: Path) -> None:
    """Every request's outcome, for a closer look (not part of the results)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["index,poisoned,due_s,latency_ms,status,verdict,detail"]
    lines += [
        f"{o.index},{int(o.poisoned)},{o.due_s:.4f},{o.latency_ms:.2f},{o.status},{o.verdict},"
        + o.detail[:120].replace(",", ";").replace("\n", " ")
        for o in outcomes
    ]
    path.write_text("\n".join(lines) + "\n")


def _by_second(outcomes: list[Outcome]) -> list[list[float]]:
    """[second the requests were due in, how many, p50 ms, max ms]: where the slow ones fall."""
    seconds: dict[int, list[float]] = {}
    for o in outcomes:
        seconds.setdefault(int(o.due_s), []).append(o.latency_ms)
    return [
        [s, len(v), round(float(np.median(v)), 1), round(max(v), 1)]
        for s, v in sorted(seconds.items())
    ]


def _model_answers(directory: Path) -> None:
    argv = [sys.executable, "-m", "bench.models.tokens", "--dir", str(directory)]
    argv += ["--rows", str(directory / "rows.npy")]
    out = subprocess.run(argv, capture_output=True, text=True, env=subprocess_env())
    if out.returncode != 0:
        raise RuntimeError(f"building the chaos model failed: {out.stderr[-1500:]}")


def _wait_healthy(status_url: str, replicas: int, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    healthy = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(status_url, timeout=5) as response:
                healthy = int(orjson.loads(response.read())["replicas"]["healthy"])
        except (OSError, KeyError, ValueError):
            healthy = None
        if healthy == replicas:
            break
        time.sleep(0.5)  # polling another process; there is no event to wait on
    return healthy


def render(results: dict[str, Any]) -> str:
    v, plan = results["verdicts"], results["plan"]
    lat, near = results["latency_ms"], results["latency_after_kill_ms"]
    settled = results["latency_after_first_poisoned_answer_ms"]
    server = results["server"]
    done = [k for k in results["kills"] if k["pid"] is not None]
    lines = [
        "| requests | poisoned | good answered right | lost | wrong | poisoned with own 422 "
        "| p50 ms | p99 ms | p99 ms after the first 422 | p99 ms, 2 s after a kill | max ms "
        "| kills | recovered | rebuilt |",
        "|" + "---|" * 14,
        f"| {results['requests']:,} | {results['poisoned']} | {v['ok']:,} | {v['lost']} "
        f"| {v['wrong']} | {v['poison_422']} of {results['poisoned']} | {lat.get('p50', 0):.1f} "
        f"| {lat.get('p99', 0):.1f} | {settled.get('p99', 0):.1f} | {near.get('p99', 0):.1f} "
        f"| {lat.get('max', 0):.1f} "
        f"| {len(done)} | {server['shardserve_replica_recoveries_total']:g} "
        f"| {server['shardserve_replica_rebuilds_total']:g} |",
        "",
        f"{plan['seconds']:g} s at {plan['rate']:g} req/s, {plan['replicas']} replicas, "
        f"--shard-max-restarts {plan['max_restarts']}, one shard actor killed every "
        f"{plan['kill_every_s']:g} s; healthy replicas at the end: "
        f"{results['healthy_replicas_at_end']}.",
    ]
    front = results.get("frontend")
    if front:
        b, a = front["before"], front["after"]
        lines.append(
            f"Front end: RSS {b['rss_mb']:.0f} -> {a['rss_mb']:.0f} MB, TensorFlow loaded "
            f"{'yes' if b['tensorflow_loaded'] else 'no'} -> "
            f"{'yes' if a['tensorflow_loaded'] else 'no'}."
        )
    lost_or_wrong = v["lost"] + v["wrong"] + v["poison_wrong"]
    verdict = "met" if lost_or_wrong == 0 else "**missed**"
    lines += ["", f"Target (0 lost, 0 wrong, every poisoned request its own 422): {verdict}."]
    return "\n".join(lines) + "\n"


def add_parsers(sub: Any) -> None:
    about = "kill -9 shard actors and poison rows under load"
    opts = options.suite(
        sub, "chaos", about, out="docs/bench-faults", plan=ChaosPlan, run=run_chaos, render=render
    )
    opts.add("seconds")
    opts.own("--rate", type=float)
    opts.own("--kill-every", dest="kill_every_s", type=float)
    opts.own("--poison-fraction", type=float)
    opts.own("--replicas", type=int)
    opts.own("--shard-max-restarts", dest="max_restarts", type=int)
    opts.add("max_batch_size", "batch_timeout_ms", "seed", "port", "workdir")
