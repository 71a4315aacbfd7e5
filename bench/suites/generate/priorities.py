"""``python -m bench generate --priorities``: does a high-priority prompt hold its time to first
token under a saturating low-priority load (issue 41's "Done when")?

One shardserve server (``--kv-slots B``, the generate suite's model and flags) and, per round:

An uncounted round comes first (the model's step shapes are traced on first use).

1. **Idle**: ``--probes`` high prompts one after the other, ``max_tokens`` 1 (the answer's
   latency is its TTFT, timed at the client), then the same prompts with ``max_tokens`` 1 + D:
   the idle decode step is the medians' difference over D. The goal: the idle TTFT p95 + 2
   decode steps.
2. **Low alone**: ``--low-clients`` (0: 2 x B) closed-loop clients (in a child process, apart
   from the probes' client) send low-priority prompts
   (the plan's lengths and ``max_tokens``) back to back: every slot taken, a queue behind them.
   The low level's tokens/s over ``--duration`` s (``shardserve_generated_tokens_total``).
3. **Low + high**: the same load, and ``--probes`` high prompts (``max_tokens`` 1) spread
   evenly over ``--duration`` s, one at a time: their TTFT p95 (each preempts a low sequence
   where every slot is taken), the low level's tokens/s (the probes' own tokens taken off), the
   preemptions (``shardserve_generation_preemptions_total``).

Reported: the medians over ``--rounds`` rounds; the low level's tokens/s lost = 1 - (3) / (2)
(the probes' own slot time and the preempted sequences' re-prefill together). The requests are
seeded: every round sends the same ones.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import time
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from bench import options
from bench.models.generation import prompts, save_preset
from bench.observe.quiet import other_benches
from bench.observe.scrape import Samples, delta, free_port, scrape
from bench.options import Progress
from bench.suites.generate.report import percentile

if TYPE_CHECKING:
    from bench.suites.generate.run import GeneratePlan

DECODE_EXTRA = 8  # D: the extra tokens that time the idle decode step
TOKENS = "shardserve_generated_tokens_total"
PREEMPTED = 'shardserve_generation_preemptions_total{priority="low"}'
FIGURES = (
    "idle_ttft_p50_s",
    "idle_ttft_p95_s",
    "decode_step_s",
    "goal_s",
    "high_ttft_p50_s",
    "high_ttft_p95_s",
    "low_tokens_per_s_alone",
    "low_tokens_per_s_with_high",
    "low_tokens_lost",
    "preemptions",
    "low_errors",
)


def _body(ids: tuple[int, ...], max_tokens: int, priority: str) -> bytes:
    parameters = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "stop_token_ids": [],
        "priority": priority,
    }
    return orjson.dumps({"input_ids": list(ids), "parameters": parameters})


async def _low_clients(url: str, bodies: list[bytes], n: int, errors: Any, stop: Any) -> None:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        sent = 0

        async def loop() -> None:
            nonlocal sent
            while True:
                body = bodies[sent % len(bodies)]
                sent += 1
                answer = await client.post(url, content=body)
                if answer.status_code != 200:
                    with errors.get_lock():
                        errors.value += 1
                    await asyncio.sleep(0.05)

        tasks = [asyncio.ensure_future(loop()) for _ in range(n)]
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _low_process(url: str, bodies: list[bytes], n: int, errors: Any, stop: Any) -> None:
    asyncio.run(_low_clients(url, bodies, n, errors, stop))


class _Lows:
    """Closed-loop low-priority clients in a process of their own (so that the probes' client
    shares no event loop with them), each sending the next of ``bodies`` once answered."""

    def __init__(self, url: str, bodies: list[bytes], n: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._errors = context.Value("i", 0)
        self._stop = context.Event()
        self._process = context.Process(
            target=_low_process, args=(url, bodies, n, self._errors, self._stop), daemon=True
        )
        self._process.start()

    @property
    def errors(self) -> int:
        return int(self._errors.value)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._process.join, 30)
        if self._process.is_alive():
            self._process.kill()


async def _timed(client: httpx.AsyncClient, url: str, body: bytes) -> float:
    started = time.perf_counter()
    answer = await client.post(url, content=body)
    seconds = time.perf_counter() - started
    if answer.status_code != 200:
        raise RuntimeError(f"a high-priority probe failed: {answer.status_code} {answer.text}")
    return seconds


async def _scrape(base: str) -> Samples:
    return await asyncio.to_thread(scrape, base)


async def _until_idle(base: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await _scrape(base)).get("shardserve_running_sequences", 0.0) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not go idle")
        await asyncio.sleep(0.1)


async def _round(
    plan: GeneratePlan, url: str, base: str, round_: int, progress: Progress
) -> dict[str, Any]:
    seed = plan.seed * 1000 + round_ + 1  # the warm-up round (-1) too: seeds are >= 0
    probes = prompts(plan.probes, seed, lengths=(plan.min_prompt, plan.max_prompt))
    lows = prompts(
        256, seed + 500, lengths=(plan.min_prompt, plan.max_prompt),
        max_tokens=(plan.min_tokens, plan.max_tokens),
    )  # fmt: skip
    low_bodies = [_body(p.ids, p.max_tokens, "low") for p in lows]
    clients = plan.low_clients or 2 * plan.batch
    async with httpx.AsyncClient(timeout=600) as client:
        await _until_idle(base)
        idle = [await _timed(client, url, _body(p.ids, 1, "high")) for p in probes]
        longer = [await _timed(client, url, _body(p.ids, 1 + DECODE_EXTRA, "high")) for p in probes]
        step = max(0.0, statistics.median(longer) - statistics.median(idle)) / DECODE_EXTRA
        load = _Lows(url, low_bodies, clients)
        try:
            await asyncio.sleep(plan.warmup_s)  # every slot taken, a queue behind them
            before = await _scrape(base)
            await asyncio.sleep(plan.duration_s)
            middle = await _scrape(base)
            alone_s = plan.duration_s
            started = time.perf_counter()
            high: list[float] = []
            gap = plan.duration_s / plan.probes
            for i, p in enumerate(probes):
                await asyncio.sleep(max(0.0, started + i * gap - time.perf_counter()))
                high.append(await _timed(client, url, _body(p.ids, 1, "high")))
            await asyncio.sleep(max(0.0, started + plan.duration_s - time.perf_counter()))
            with_s = time.perf_counter() - started
            after = await _scrape(base)
        finally:
            await load.stop()
    low_alone = delta(middle, before, TOKENS) / alone_s
    low_with = (delta(after, middle, TOKENS) - len(high)) / with_s
    idle_p95 = percentile(idle, 95)
    assert idle_p95 is not None
    record = {
        "round": round_,
        "idle_ttft_p50_s": percentile(idle, 50),
        "idle_ttft_p95_s": idle_p95,
        "decode_step_s": step,
        "goal_s": idle_p95 + 2 * step,
        "high_ttft_p50_s": percentile(high, 50),
        "high_ttft_p95_s": percentile(high, 95),
        "low_tokens_per_s_alone": low_alone,
        "low_tokens_per_s_with_high": low_with,
        "low_tokens_lost": 1 - low_with / low_alone if low_alone else None,
        "preemptions": delta(after, middle, PREEMPTED),
        "low_errors": load.errors,
        "low_clients": clients,
        "loadavg_1min": os.getloadavg()[0],
    }
    progress(
        f"  r{round_}: idle TTFT p95 {idle_p95 * 1000:.1f} ms + 2 x {step * 1000:.1f} ms step = "
        f"goal {(idle_p95 + 2 * step) * 1000:.1f} ms; high TTFT p95 under load "
        f"{_ms(record['high_ttft_p95_s'])} ms; low {low_alone:.1f} -> "
        f"{low_with:.1f} tok/s; {record['preemptions']:.0f} preemptions; load "
        f"{record['loadavg_1min']:.1f}"
    )
    return record


def run_priorities(plan: GeneratePlan, progress: Progress) -> dict[str, Any]:
    from bench.suites.generate.run import server  # here: run.py imports this module

    progress(f"saving the model: {plan.shape.describe()}")
    preset = save_preset(plan.shape, plan.workdir)
    port = plan.port or free_port()
    results: dict[str, Any] = {
        "bench": "generate-priorities",
        "plan": options.plan_json(plan),
        "model": plan.shape.describe(),
        "rounds": [],
        "other_benches": other_benches(),
    }
    progress(f"[shardserve] starting on port {port}, kv slots {plan.batch}")
    with server(plan, preset, "shardserve", port) as srv:
        base = srv.url.split("/v2/")[0]
        # An uncounted round first: every step shape the rounds meet (prefill rows x prompt
        # bucket, beside decode rows) is traced on its first use, a second or so each.
        progress("  warm-up round (not counted)")
        asyncio.run(_round(plan, srv.url, base, -1, progress))
        for round_ in range(plan.rounds):
            record = asyncio.run(_round(plan, srv.url, base, round_, progress))
            results["rounds"].append(record)
    results["medians"] = {
        name: statistics.median(vs) if (vs := _values(results["rounds"], name)) else None
        for name in FIGURES
    }
    return results


def _values(records: list[dict[str, Any]], name: str) -> list[float]:
    return [r[name] for r in records if r.get(name) is not None]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def render_priorities(results: dict[str, Any]) -> str:
    m = results["medians"]
    plan = results["plan"]
    goal, high = m["goal_s"], m["high_ttft_p95_s"]
    met = "met" if goal is not None and high is not None and high <= goal else "not met"
    lost = m["low_tokens_lost"]
    lines = [
        f"# Generation priorities ({results['model']}, {plan['stages']} stages, "
        f"{plan['batch']} KV slots; medians of {len(results['rounds'])} round(s))",
        "",
        "| figure | value |",
        "|---|---|",
        f"| idle TTFT p50 / p95 (ms) | {_ms(m['idle_ttft_p50_s'])} / {_ms(m['idle_ttft_p95_s'])} |",
        f"| idle decode step (ms) | {_ms(m['decode_step_s'])} |",
        f"| goal: idle TTFT p95 + 2 steps (ms) | {_ms(goal)} |",
        f"| high TTFT p50 / p95 under saturating low load (ms) | {_ms(m['high_ttft_p50_s'])} / "
        f"{_ms(high)} ({met}) |",
        f"| low tokens/s alone / with the high probes | {m['low_tokens_per_s_alone']:.1f} / "
        f"{m['low_tokens_per_s_with_high']:.1f} |",
        f"| low tokens/s lost | {'-' if lost is None else f'{lost:.1%}'} |",
        f"| preemptions per round | {m['preemptions']:.0f} |",
        f"| low requests failed | {m['low_errors']:.0f} |",
    ]
    return "\n".join(lines) + "\n"
