"""``python -m bench generate``: iteration-level batching against request-level batching
(issue 39's "Done when").

A GPT-2-shaped causal LM built in code (``--blocks`` x ``--hidden``, a small vocabulary, saved
with ``save_to_preset``: ``bench.models.generation``) is served, one system after the other:

- **shardserve**: ``shardserve serve --model PRESET --stages K --kv-slots B`` and its
  ``/v2/models/gpt/generate`` route (the iteration-level scheduler, K + 1 groups in flight);
- **shardserve-1group**: the same with ``--generation-groups 1``: one group in flight, so the
  pipeline's stages take turns (what K + 1 groups buy);
- **litserve**: LitServe with ``max_batch_size`` B and ``--batch-timeout-ms`` around keras_hub's
  ``generate`` (padded to one shape, each batch running until its longest sequence ends:
  ``bench.systems.litserve_generate``).

Each gets an uncounted warm-up (short answers at twice the top rate), then per round, at each
of ``--rates`` rising: Poisson arrivals for ``--duration`` s of prompts of ``--min-prompt``..
``--max-prompt`` ids with ``max_tokens`` uniform in ``--min-tokens``..``--max-tokens``, stop ids
off (the same seeded requests for every system). Reported: the medians over ``--rounds`` rounds
of useful tokens/s (beside those the arrivals asked for), TTFT and TPOT p50/p95, the latency,
shardserve's rows per step (``/metrics``) and the CPU per part; each system's capacity (the
highest rate whose p95 TTFT <= ``--ttft-limit`` s) and the highest rate it kept up with (no
queueing: below); and
keras_hub's ``generate`` alone at batch B in one process (``bench.systems.keras_generate``: the
model's ceiling). Systems run one after the other, each on its own server.
A round stops climbing for a system at the first rate it fell behind (its p95 latency past
``QUEUEING`` x its own at the lowest rate): a higher one would only take longer to drain.

Then the streamed path (issue 40, ``bench.suites.generate.streamed``): ``/v1/completions`` with
``"stream": true`` against the same requests plain, closed loop, on a shardserve server of its
own. ``--paths`` chooses: ``systems`` (the systems and the ceiling), ``streamed``, both by
default; ``--streamed`` is ``--paths streamed``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench import options
from bench.load import genload
from bench.models.generation import ModelShape, body, prompts, save_preset
from bench.observe.cpusplit import cores, cpu_seconds
from bench.observe.quiet import other_benches
from bench.observe.scrape import free_port, scrape
from bench.options import Progress
from bench.suites.generate.priorities import render_priorities, run_priorities
from bench.suites.generate.report import (
    STEP_ROWS,
    TPOT,
    TTFT,
    histogram_mean,
    histogram_quantile,
    percentile,
    queueing,
    render,
)
from bench.suites.generate.streamed import combined, run_streamed
from bench.systems import ServerProcess, SystemConfig
from bench.systems.base import LaunchSpec, python_module, subprocess_env
from bench.systems.shardserve import shardserve_spec

SYSTEMS = ("shardserve", "shardserve-1group", "litserve")
PATHS = ("systems", "streamed")
MODEL_NAME = "gpt"


@dataclass(frozen=True)
class GeneratePlan:
    blocks: int = 12
    hidden: int = 512
    stages: int = 2
    batch: int = 8  # the KV slots, the peer's max batch, the ceiling's batch
    batch_timeout_ms: float = 100.0  # the peer's wait for a batch to fill
    rates: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)
    duration_s: float = 30.0
    rounds: int = 3
    warmup_s: float = 10.0
    ttft_limit_s: float = 2.0
    systems: tuple[str, ...] = SYSTEMS
    ceiling_s: float = 20.0  # 0: not measured
    min_prompt: int = 16
    max_prompt: int = 64
    min_tokens: int = 8
    max_tokens: int = 128
    seed: int = 0
    port: int = 0  # the first system's; the next ones count up from it (0: free ports)
    workdir: Path = Path(".bench/generate")
    # What runs: "systems" (and the ceiling), "streamed" (issue 40's streamed path against the
    # plain one); its clients 0: one per KV slot.
    paths: tuple[str, ...] = PATHS
    stream_s: float = 20.0
    stream_clients: int = 0
    # --priorities: high-priority TTFT under a saturating low load instead (priorities.py)
    priorities: bool = False
    probes: int = 20  # high prompts per phase of a round
    low_clients: int = 0  # closed-loop low clients (0: 2 x batch)

    def __post_init__(self) -> None:
        options.require(
            self,
            at_least_one=("blocks", "hidden", "stages", "batch", "rounds", "probes"),
            positive=("duration_s", "warmup_s", "ttft_limit_s", "stream_s"),
        )
        wrong = sorted(set(self.paths) - set(PATHS))
        if wrong or not self.paths:
            named = repr(wrong[0]) if wrong else "(none)"
            raise ValueError(f"unknown path {named}; of {', '.join(PATHS)}")
        if self.stream_clients < 0:
            raise ValueError(f"stream_clients must be >= 0, got {self.stream_clients}")
        if not self.rates or min(self.rates) <= 0:
            raise ValueError(f"rates must be > 0, got {self.rates}")
        if not 1 <= self.min_prompt <= self.max_prompt:
            raise ValueError(
                f"prompts need 1 <= min <= max, got {self.min_prompt}..{self.max_prompt}"
            )
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"max_tokens needs 1 <= min <= max, got {self.min_tokens}..{self.max_tokens}"
            )
        if self.stages > self.blocks:
            raise ValueError(f"stages ({self.stages}) must be at most blocks ({self.blocks})")
        unknown = sorted(set(self.systems) - set(SYSTEMS))
        if unknown or not self.systems:
            named = repr(unknown[0]) if unknown else "(none)"
            raise ValueError(f"unknown system {named}; of {', '.join(SYSTEMS)}")

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.blocks, self.hidden, self.max_prompt + self.max_tokens)

    def requests(self, n: int, seed: int, max_tokens: tuple[int, int] | None = None) -> list[bytes]:
        """``n`` generate bodies, seeded (``max_tokens``: another range than the plan's)."""
        drawn = prompts(
            n,
            seed,
            lengths=(self.min_prompt, self.max_prompt),
            max_tokens=max_tokens or (self.min_tokens, self.max_tokens),
        )
        return [body(p) for p in drawn]


def _port(plan: GeneratePlan, index: int) -> int:
    return plan.port + index if plan.port else free_port()


def server(plan: GeneratePlan, preset: Path, system: str, port: int) -> ServerProcess:
    """The system's server, ready once a generate request is answered."""
    log = plan.workdir / "logs" / f"{system}.log"
    ready = body(prompts(1, 0, lengths=(plan.min_prompt,) * 2, max_tokens=(2, 2))[0])
    length = str(plan.shape.max_length)
    if system == "litserve":
        argv = python_module(
            "bench.systems.litserve_generate",
            *("--model", str(preset), "--port", str(port), "--length", length),
            *("--max-batch-size", str(plan.batch)),
            *("--batch-timeout-ms", f"{plan.batch_timeout_ms:g}"),
        )
        return ServerProcess(LaunchSpec(system, argv, ready_timeout_s=600), port, ready, log)
    flags = {
        "--model-name": MODEL_NAME,
        "--kv-slots": str(plan.batch),
        "--max-sequence-length": length,
        "--grpc-port": "0",
    }
    if system == "shardserve-1group":
        flags["--generation-groups"] = "1"
    config = SystemConfig(preset, port)
    spec = shardserve_spec(config, plan.stages, plan.workdir / "cache", flags=flags)
    spec = LaunchSpec(system, spec.argv, ready_timeout_s=600)
    path = f"/v2/models/{MODEL_NAME}/generate"
    return ServerProcess(spec, port, ready, log, path=path)


def measure(
    plan: GeneratePlan, srv: ServerProcess, system: str, rate: float, round_: int, seed: int
) -> dict[str, Any]:
    """One rate of one round: the load, and what the server's metrics and CPU say of it."""
    base = srv.url.split("/v2/")[0].removesuffix("/predict")
    metrics = system != "litserve"
    bodies = plan.requests(int(rate * plan.duration_s * 1.5) + 16, seed)
    before = scrape(base) if metrics else {}
    cpu_before = cpu_seconds(srv.pid)
    load = genload.run(srv.url, bodies, rate, plan.duration_s, seed, plan.workdir)
    cpu = cores(cpu_before, cpu_seconds(srv.pid), load.seconds)
    after = scrape(base) if metrics else {}
    latency = load.latencies_s
    per_token = [lat / n for lat, n in zip(latency, load.tokens, strict=True) if n]
    # What the arrivals asked for: a server that kept up answers it within the run.
    offered = sum(
        orjson.loads(bodies[i % len(bodies)])["parameters"]["max_tokens"] for i in range(load.sent)
    )
    record: dict[str, Any] = {
        "system": system,
        "rate": rate,
        "round": round_,
        "sent": load.sent,
        "errors": load.errors,
        "statuses": load.statuses,
        "seconds": load.seconds,
        "tokens": sum(load.tokens),
        "asked_tokens": offered,
        "tokens_per_s": sum(load.tokens) / load.seconds if load.seconds else 0.0,
        "offered_tokens_per_s": offered / plan.duration_s,
        "latency_p50_s": percentile(latency, 50),
        "latency_p95_s": percentile(latency, 95),
        "cpu": cpu,
        "loadavg_1min": os.getloadavg()[0],
    }
    if metrics:
        record |= {
            "ttft_source": "server histogram",
            "ttft_p50_s": histogram_quantile(after, before, TTFT, 0.5),
            "ttft_p95_s": histogram_quantile(after, before, TTFT, 0.95),
            "ttft_mean_s": histogram_mean(after, before, TTFT),
            "tpot_p50_s": histogram_quantile(after, before, TPOT, 0.5),
            "tpot_p95_s": histogram_quantile(after, before, TPOT, 0.95),
            "tpot_mean_s": histogram_mean(after, before, TPOT),
            "rows_per_step": histogram_mean(after, before, STEP_ROWS),
        }
    else:  # the whole answer comes at the end of its batch
        record |= {
            "ttft_source": "full latency",
            "ttft_p50_s": record["latency_p50_s"],
            "ttft_p95_s": record["latency_p95_s"],
            "tpot_p50_s": percentile(per_token, 50),
            "tpot_p95_s": percentile(per_token, 95),
            "rows_per_step": None,
        }
    return record


def _say(progress: Progress, r: dict[str, Any]) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    rows = "-" if r["rows_per_step"] is None else f"{r['rows_per_step']:.1f}"
    progress(
        f"  [{r['system']}] r{r['round']} {r['rate']:g} req/s: {r['tokens_per_s']:.1f} tok/s, "
        f"TTFT p50/p95 {ms(r['ttft_p50_s'])}/{ms(r['ttft_p95_s'])} ms, TPOT "
        f"{ms(r['tpot_p50_s'])}/{ms(r['tpot_p95_s'])} ms, rows/step {rows}, sent {r['sent']} "
        f"failed {r['errors']}, load {r['loadavg_1min']:.1f}"
    )


def run_system(
    plan: GeneratePlan, preset: Path, system: str, port: int, progress: Progress
) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    progress(f"[{system}] starting on port {port}")
    with server(plan, preset, system, port) as srv:
        # Short answers at the top rate: every prefill shape (rows x prompt bucket) is traced
        # on its first use, a second or so each, and should not land in the first rate.
        warm = plan.requests(int(plan.warmup_s * max(plan.rates)) + 16, plan.seed + 99, (1, 4))
        rate = max(plan.rates) * 2
        genload.run(srv.url, warm, rate, plan.warmup_s, plan.seed + 99, plan.workdir)
        for round_ in range(plan.rounds):
            base: float | None = None  # the p95 latency at the lowest rate
            for i, rate in enumerate(sorted(plan.rates)):
                seed = plan.seed * 1000 + round_ * 100 + i  # the same requests for every system
                record = measure(plan, srv, system, rate, round_, seed)
                _say(progress, record)
                runs.append(record)
                base = base if i else record["latency_p95_s"]
                if queueing(record["latency_p95_s"], base):
                    progress(
                        f"  [{system}] fell behind at {rate:g} req/s: no higher rate this round"
                    )
                    break
    return runs


def ceiling(plan: GeneratePlan, preset: Path) -> dict[str, Any]:
    """keras_hub's generate at batch B in a child process (the driver loads no TensorFlow)."""
    rows_file = plan.workdir / "ceiling-rows.json"
    rows = [orjson.loads(b) for b in plan.requests(plan.batch * 16, plan.seed + 7)]
    rows_file.write_bytes(
        orjson.dumps([[r["input_ids"], r["parameters"]["max_tokens"]] for r in rows])
    )
    argv = [sys.executable, "-m", "bench.systems.keras_generate", "--model", str(preset)]
    argv += ["--batch", str(plan.batch), "--length", str(plan.shape.max_length)]
    argv += ["--rows", str(rows_file), "--seconds", f"{plan.ceiling_s:g}"]
    out = subprocess.run(argv, capture_output=True, text=True, env=subprocess_env())
    if out.returncode != 0:
        raise RuntimeError(f"the ceiling failed: {out.stderr[-1500:]}")
    return dict(orjson.loads(out.stdout.strip().splitlines()[-1]))


def run(plan: GeneratePlan, progress: Progress = print) -> dict[str, Any]:
    if plan.priorities:
        return run_priorities(plan, progress)
    progress(f"saving the model: {plan.shape.describe()}")
    preset = save_preset(plan.shape, plan.workdir)
    results: dict[str, Any] = {
        "bench": "generate",
        "plan": options.plan_json(plan),
        "model": plan.shape.describe(),
        "runs": [],
        "ceiling": None,
        "streamed": None,
        "other_benches": other_benches(),
    }
    systems = plan.systems if "systems" in plan.paths else ()
    for index, system in enumerate(systems):
        results["runs"] += run_system(plan, preset, system, _port(plan, index), progress)
    if systems and plan.ceiling_s > 0:
        progress(f"keras_hub generate alone, batch {plan.batch}, {plan.ceiling_s:g} s")
        results["ceiling"] = ceiling(plan, preset)
        progress(f"  ceiling: {results['ceiling']}")
    if "streamed" in plan.paths:
        port = _port(plan, len(systems))
        results["streamed"] = streamed_path(plan, preset, port, progress)
    return results


def streamed_path(
    plan: GeneratePlan, preset: Path, port: int, progress: Progress
) -> dict[str, Any]:
    """The streamed path against the plain one, on a shardserve server of its own."""
    progress(f"[streamed] starting shardserve on port {port}")
    with server(plan, preset, "shardserve", port) as srv:
        base = srv.url.split("/v2/")[0]
        return run_streamed(plan, base, MODEL_NAME, progress, srv.pid)


def add_parsers(sub: Any) -> None:
    about = "generation: iteration-level vs request-level batching (LitServe), Poisson (issue 39)"
    opts = options.suite(
        sub,
        "generate",
        about,
        out="docs/bench-generate",
        plan=GeneratePlan,
        run=run,
        render=_render,
    )
    opts.own("--blocks", type=int, help="decoder blocks of the model")
    opts.own("--hidden", type=int, help="its width")
    opts.add("stages")
    opts.own("--batch", type=int, help="KV slots = the peer's max batch = the ceiling's batch")
    opts.add("batch_timeout_ms", help="the peer's wait for its batch to fill")
    opts.own("--rates", type=options.floats, help="comma-separated req/s, Poisson")
    opts.own("--duration", dest="duration_s", type=float, help="seconds of load per rate")
    opts.own("--rounds", type=int, help="the medians are over these")
    opts.add("warmup_s")
    opts.own("--ttft-limit", dest="ttft_limit_s", type=float, help="s, p95, for the capacity")
    opts.own("--systems", type=options.csv, help=f"comma-separated, of {', '.join(SYSTEMS)}")
    opts.add("ceiling_s", help="s of keras_hub's generate alone (0: skipped)")
    opts.own("--min-prompt", type=int)
    opts.own("--max-prompt", type=int)
    opts.own("--min-tokens", type=int)
    opts.own("--max-tokens", type=int)
    opts.add("seed", "port", "workdir")
    opts.own("--paths", type=options.csv, help=f"comma-separated, of {', '.join(PATHS)}")
    alone = "--paths streamed: only the streamed path against the plain one (issue 40)"
    opts.own("--streamed", dest="paths", action="store_const", const=("streamed",), help=alone)
    opts.own("--stream-seconds", dest="stream_s", type=float, help="s per path per round")
    opts.own("--stream-clients", type=int, help="closed-loop clients (0: one per KV slot)")
    opts.own(
        "--priorities",
        action="store_true",
        default=None,
        help="high-priority TTFT under a saturating low-priority load instead (issue 41)",
    )
    opts.own("--probes", type=int, help="--priorities: high prompts per phase of a round")
    opts.own("--low-clients", type=int, help="--priorities: closed-loop low clients (0: 2 x batch)")


def _render(results: dict[str, Any]) -> str:
    if results.get("bench") == "generate-priorities":
        return render_priorities(results)
    return combined(render)(results)
