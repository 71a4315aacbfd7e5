"""``python -m bench generate``'s streamed path (issue 40): ``/v1/completions`` with
``"stream": true`` against the same requests without, on one shardserve server in one run.

Closed loop (``bench.load.sseload``): ``stream_clients`` clients (0: one per KV slot, so that the
slots stay full and tokens/s is the server's capacity, not the offered load) send the plan's
seeded prompts back to back for ``stream_s`` seconds per path, the paths' order alternating
round by round. Per path and round: tokens/s (``usage.completion_tokens`` over the first
request to the last answer), TTFT p50/p95 and the latency p50/p95, the client's clock. TTFT of
the stream: its first SSE event with text; of the plain answer: the whole answer (a plain client
sees no text before it), so the two TTFTs say what a client waits for, not the same span.
Reported: each figure's median over the rounds, and streamed / plain tokens/s (the goal: >= 0.90,
streaming costs at most 10%). The model stops at its end token on these routes (OpenAI's have
no ``stop_token_ids``), and greedy, the random model falls on it within a few tokens: the
requests sample at temperature 1 instead, each with its own ``seed`` (the draw of token t is
keyed by (seed, t)), so both paths generate the same tokens for a request and most answers run
to their ``max_tokens``. An answer whose first token is the end token has no TTFT on either path.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson

from bench.load import sseload
from bench.observe.cpusplit import cores, cpu_seconds
from bench.options import Progress
from bench.suites.generate.report import percentile

PATHS = ("plain", "streamed")
GOAL = 0.90  # streamed / plain tokens/s
# Figures of one path's round that the medians are taken of.
STREAM_FIGURES = (
    "tokens_per_s",
    "frontend_ms_per_token",
    "workers_ms_per_token",
    "ttft_p50_s",
    "ttft_p95_s",
    "latency_p50_s",
    "latency_p95_s",
    "errors",
)


class _Plan(Protocol):
    """What the streamed path reads of ``GeneratePlan`` (frozen: read-only)."""

    @property
    def batch(self) -> int: ...
    @property
    def rounds(self) -> int: ...
    @property
    def warmup_s(self) -> float: ...
    @property
    def stream_s(self) -> float: ...
    @property
    def stream_clients(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def workdir(self) -> Path: ...

    def requests(
        self, n: int, seed: int, max_tokens: tuple[int, int] | None = None
    ) -> list[bytes]: ...


def completion_bodies(generate_bodies: Sequence[bytes], model: str) -> list[bytes]:
    """The generate route's bodies as ``/v1/completions`` ones: the same ids and max_tokens,
    sampled at temperature 1 with a seed of their own (body i: seed i; ``stream`` is the load
    generator's to add)."""
    out = []
    for seed, raw in enumerate(generate_bodies):
        request = orjson.loads(raw)
        body = {
            "model": model,
            "prompt": request["input_ids"],
            "max_tokens": request["parameters"]["max_tokens"],
            "temperature": 1.0,
            "seed": seed,
        }
        out.append(orjson.dumps(body))
    return out


def record(
    load: sseload.SSELoad, round_: int, cpu: dict[str, float] | None = None
) -> dict[str, Any]:
    """One path's round: what its clients saw, and the server's CPU per token (``cpu``: cores
    per part over the round, ``bench.observe.cpusplit.cores``)."""
    tokens = sum(load.tokens)

    def ms_per_token(part: str) -> float | None:
        if cpu is None or part not in cpu or not tokens:
            return None
        return 1000.0 * cpu[part] * load.seconds / tokens

    return {
        "path": "streamed" if load.stream else "plain",
        "round": round_,
        "sent": load.sent,
        "errors": load.errors,
        "failures": load.failures,
        "seconds": load.seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / load.seconds if load.seconds else 0.0,
        "ttft_p50_s": percentile(load.first_s, 50),
        "ttft_p95_s": percentile(load.first_s, 95),
        "latency_p50_s": percentile(load.latencies_s, 50),
        "latency_p95_s": percentile(load.latencies_s, 95),
        "cpu": cpu,
        "frontend_ms_per_token": ms_per_token("frontend"),
        "workers_ms_per_token": ms_per_token("shard_actors"),
        "loadavg_1min": os.getloadavg()[0],
    }


def run_streamed(
    plan: _Plan, base: str, model: str, progress: Progress, pid: int | None = None
) -> dict[str, Any]:
    """Both paths on the server at ``base`` (running; ``pid``: its process, for the CPU per
    token), each round in turn."""
    clients = plan.stream_clients or plan.batch
    # Enough bodies that no client repeats one within a round at a few requests per second.
    bodies = completion_bodies(plan.requests(clients * 64, plan.seed + 40), model)
    workdir = plan.workdir / "streamed"

    def load(stream: bool, seconds: float) -> sseload.SSELoad:
        return sseload.run(base, bodies, clients, seconds, stream, workdir)

    progress(f"[streamed] {clients} closed-loop clients, {plan.stream_s:g} s per path per round")
    for stream in (False, True):  # every prefill shape traced, both paths' code warm
        load(stream, plan.warmup_s)
    runs: list[dict[str, Any]] = []
    for round_ in range(plan.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        for stream in order:
            before = cpu_seconds(pid) if pid else None
            done = load(stream, plan.stream_s)
            cpu = cores(before, cpu_seconds(pid), done.seconds) if pid and before else None
            r = record(done, round_, cpu)
            progress(
                f"  [{r['path']}] r{round_}: {r['tokens_per_s']:.1f} tok/s, TTFT p50/p95 "
                f"{_ms(r['ttft_p50_s'])}/{_ms(r['ttft_p95_s'])} ms, CPU ms/token front end "
                f"{_f(r['frontend_ms_per_token'])} stages {_f(r['workers_ms_per_token'])}, "
                f"sent {r['sent']} failed "
                f"{r['errors']}, load {r['loadavg_1min']:.1f}"
            )
            runs.append(r)
    return {"clients": clients, "seconds": plan.stream_s, "runs": runs}


def summarize_streamed(streamed: dict[str, Any]) -> dict[str, Any]:
    """Each path's medians over its rounds, and streamed / plain tokens/s (of the medians, and
    each round's own)."""
    paths: dict[str, dict[str, Any]] = {}
    for path in PATHS:
        runs = [r for r in streamed["runs"] if r["path"] == path]
        medians: dict[str, Any] = {"rounds": len(runs)}
        for name in STREAM_FIGURES:
            values = [r[name] for r in runs if r.get(name) is not None]
            medians[name] = statistics.median(values) if values else None
        paths[path] = medians
    plain, stream = paths["plain"]["tokens_per_s"], paths["streamed"]["tokens_per_s"]
    ratio = stream / plain if plain and stream is not None else None
    by_round: dict[int, dict[str, float]] = {}
    for r in streamed["runs"]:
        by_round.setdefault(r["round"], {})[r["path"]] = r["tokens_per_s"]
    round_ratios = [
        p["streamed"] / p["plain"]
        for _, p in sorted(by_round.items())
        if len(p) == 2 and p["plain"]
    ]
    return {
        "paths": paths,
        "ratio": ratio,
        "round_ratios": round_ratios,
        "goal_met": None if ratio is None else ratio >= GOAL,
    }


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f}"


def _f(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def render_streamed(results: dict[str, Any]) -> str:
    streamed = results["streamed"]
    summary = summarize_streamed(streamed)
    rounds = max((m["rounds"] for m in summary["paths"].values()), default=0)
    lines = [
        f"Streamed against plain, `/v1/completions` on shardserve ({results['model']}): "
        f"{streamed['clients']} closed-loop clients, {streamed['seconds']:g} s per path, medians "
        f"of {rounds} round(s).",
        "",
        "| path | tokens/s | TTFT p50 / p95 ms | latency p50 / p95 ms | CPU ms/token: front "
        "end, stages | failed |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for path, m in summary["paths"].items():
        tokens = "—" if m["tokens_per_s"] is None else f"{m['tokens_per_s']:.1f}"
        failed = "—" if m["errors"] is None else f"{m['errors']:.0f}"
        lines.append(
            f"| {path} | {tokens} | {_ms(m['ttft_p50_s'])} / {_ms(m['ttft_p95_s'])} "
            f"| {_ms(m['latency_p50_s'])} / {_ms(m['latency_p95_s'])} "
            f"| {_f(m['frontend_ms_per_token'])}, {_f(m['workers_ms_per_token'])} | {failed} |"
        )
    ratio = summary["ratio"]
    shown = "—" if ratio is None else f"{ratio:.3f}"
    each = ", ".join(f"{r:.3f}" for r in summary["round_ratios"])
    verdict = {True: "met", False: "NOT met", None: "not measured"}[summary["goal_met"]]
    lines += [
        "",
        f"- streamed / plain tokens/s: {shown} (each round: {each or '—'}); the goal, >= "
        f"{GOAL:.2f} (streaming costs at most {1 - GOAL:.0%}): {verdict}",
        "- TTFT: streamed, the first SSE event with text; plain, the whole answer (a plain "
        "client sees no text before it), answers with a token only. The client's clock, from "
        "the request sent. CPU ms/token: the server's front end and its stage actors, CPU "
        "seconds over the round per token answered (what streaming adds shows in the front "
        "end's, whatever else the machine runs).",
    ]
    return "\n".join(lines) + "\n"


def combined(render: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], str]:
    """The generate suite's Markdown: the systems' table where they ran, then the streamed
    path's where it ran."""

    def both(results: dict[str, Any]) -> str:
        parts = []
        if results["runs"] or results.get("ceiling"):
            parts.append(render(results))
        if results.get("streamed"):
            parts.append(render_streamed(results))
        return "\n".join(parts)

    return both
