"""The sweep behind ``shardserve tune --generate``: load levels x prefill timeouts x running limits
x prefill budgets, a streaming Locust run each (issue 41, item 4).

For each point the tuner sets the knobs through ``PUT /admin/models/{name}/generation`` (no
restart: ``serving.generation.knobs``), runs the streaming user (``loadtest/generate.py``) headless
in a subprocess with the operator's workload (``loadtest.workload``) and a warm-up that is not
counted, and reads the summary it writes: output tokens/s, TTFT and time per output token
p50/p95. The output files are rewritten after every point (an interrupted sweep keeps what it
measured); the server's knobs are put back at the end.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.genchoice import AUTO, NO_CAP, GenPoint, Targets
from loadtest.genreport import PLOT, write_all
from loadtest.tune import Admin, Load, parse_loads, parse_timeouts
from loadtest.workload import Workload, load_workload

__all__ = [
    "GenTuneConfig",
    "parse_budgets",
    "parse_running",
    "run_sweep",
    "tune",
    "tune_generation",
]

LOCUSTFILE = Path(__file__).with_name("generate.py")
STEP_ROWS = "shardserve_generation_step_rows"


@dataclass
class GenTuneConfig:
    url: str
    model_name: str
    out: Path
    workload: Workload
    loads: list[Load]
    timeouts: list[str]
    running: list[int] | None  # None: the server's kv_slots and half of it
    budgets: list[int | None]
    duration_s: float
    warmup_s: float = 3.0
    targets: Targets = field(default_factory=Targets)
    repeats: int = 1
    admin_token: str | None = None


def parse_running(text: str | None) -> list[int] | None:
    """``"4,8"`` -> [4, 8]; empty: ``None`` (the server's kv_slots and half of it)."""
    if not text:
        return None
    values = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--max-running wants integers >= 1, got {part!r}")
        values.append(int(part))
    return list(dict.fromkeys(values)) or None


def parse_budgets(text: str) -> list[int | None]:
    """``"none,64,256"`` -> [None, 64, 256] (``none``: no cap)."""
    values: list[int | None] = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        if part == NO_CAP:
            values.append(None)
        elif part.isdigit() and int(part) >= 1:
            values.append(int(part))
        else:
            raise ValueError(f"--prefill-budgets wants integers >= 1 or 'none', got {part!r}")
    if not values:
        raise ValueError(f"--prefill-budgets needs at least one value, got {text!r}")
    return list(dict.fromkeys(values))


class GenerationAdmin(Admin):
    """The generation knobs' admin route and the step-rows histogram."""

    def __init__(self, url: str, token: str | None, model: str) -> None:
        super().__init__(url, token)
        self.route = f"/admin/models/{model}/generation"

    def knobs(self) -> dict[str, Any]:
        return self._check(self.client.get(self.route))

    def set_knobs(self, **changes: Any) -> dict[str, Any]:
        return self._check(self.client.put(self.route, json=changes))

    def step_rows(self) -> tuple[float, float]:
        text = self.client.get("/metrics").text
        values = []
        for name in (f"{STEP_ROWS}_sum", f"{STEP_ROWS}_count"):
            found = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
            values.append(sum(float(v) for v in found))
        return values[0], values[1]


def run_locust(config: GenTuneConfig, load: Load, workload: Path, summary: Path) -> dict[str, Any]:
    run_s = math.ceil(config.warmup_s + config.duration_s)
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--host", config.url, "-u", str(load.users), "-r", str(load.users), "-t", f"{run_s}s",
        "--only-summary", "--loglevel", "WARNING", "--model-name", config.model_name,
        "--workload", str(workload), "--warmup-s", str(config.warmup_s),
        "--summary-json", str(summary),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=run_s + 120, env=env, check=False
    )
    if done.returncode not in (0, 1) or not summary.exists():  # 1: some streams failed
        tail = (done.stderr or done.stdout)[-2000:]
        raise RuntimeError(f"locust exited with {done.returncode} and no summary:\n{tail}")
    figures: dict[str, Any] = json.loads(summary.read_text())
    return figures


def _workload_file(workload: Workload, directory: Path) -> Path:
    """The workload as the Locust subprocess reads it (JSON)."""
    path = directory / "workload.json"
    data = {
        "prompt_tokens": list(workload.prompt_tokens),
        "vocabulary": workload.vocabulary,
        "max_tokens": list(workload.max_tokens),
        "temperature": workload.temperature,
        "route": workload.route,
        "stop": workload.stop,
        "seed": workload.seed,
    }
    if workload.prompts:
        data["prompts"] = [p if isinstance(p, str) else list(p) for p in workload.prompts]
    path.write_text(json.dumps(data))
    return path


def measure(
    config: GenTuneConfig,
    admin: GenerationAdmin,
    load: Load,
    setting: tuple[str, int, int | None],
) -> GenPoint:
    timeout, running, budget = setting
    admin.set_knobs(
        prefill_timeout_ms=AUTO if timeout == AUTO else float(timeout),
        max_running_sequences=running,
        prefill_budget_tokens=budget,
    )
    before = admin.step_rows()
    with tempfile.TemporaryDirectory(prefix="shardserve-gentune-") as tmp:
        workload = _workload_file(config.workload, Path(tmp))
        summary = run_locust(config, load, workload, Path(tmp) / "summary.json")
    after = admin.step_rows()
    steps = after[1] - before[1]
    return GenPoint(
        load=load.label,
        prefill_timeout_ms=timeout,
        max_running_sequences=running,
        prefill_budget_tokens=budget,
        streams=int(summary["streams"]),
        failures=int(summary["failures"]),
        tokens_per_s=float(summary["tokens_per_s"]),
        streams_per_s=float(summary["streams_per_s"]),
        ttft_p50_ms=summary["ttft_p50_ms"],
        ttft_p95_ms=summary["ttft_p95_ms"],
        tpot_p50_ms=summary["tpot_p50_ms"],
        tpot_p95_ms=summary["tpot_p95_ms"],
        rows_per_step=(after[0] - before[0]) / steps if steps > 0 else None,
    )


def plan(config: GenTuneConfig, kv_slots: int) -> list[tuple[Load, tuple[str, int, int | None]]]:
    """Every run in order: per load level, the repeats going round every setting."""
    running = config.running or list(dict.fromkeys([kv_slots, max(1, kv_slots // 2)]))
    too_many = [r for r in running if r > kv_slots]
    if too_many:
        raise ValueError(
            f"--max-running {too_many[0]} is past the server's kv_slots ({kv_slots}): a running "
            "sequence holds a slot"
        )
    settings = [(t, r, b) for t in config.timeouts for r in running for b in config.budgets]
    return [(load, s) for load in config.loads for _ in range(config.repeats) for s in settings]


def run_sweep(
    config: GenTuneConfig,
    *,
    on_point: Callable[[GenPoint, int, int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    header: str = "",
) -> tuple[list[GenPoint], bool]:
    """Measure every run; return them and whether the sweep finished (False: interrupted)."""
    admin = GenerationAdmin(config.url, config.admin_token, config.model_name)
    original = admin.knobs()
    runs = plan(config, int(original["kv_slots"]))
    if on_plan is not None:
        on_plan(len(runs))
    points: list[GenPoint] = []
    finished = False
    try:
        for load, setting in runs:
            point = measure(config, admin, load, setting)
            points.append(point)
            write_all(points, config.targets, config.out, header=header)
            if on_point is not None:
                on_point(point, len(points), len(runs))
        finished = True
    except KeyboardInterrupt:
        pass  # keep what was measured; the files already hold it
    finally:
        with contextlib.suppress(RuntimeError, httpx.HTTPError):
            admin.set_knobs(
                prefill_timeout_ms=original["prefill_timeout_ms"],
                max_running_sequences=original["max_running_sequences"],
                prefill_budget_tokens=original["prefill_budget_tokens"],
            )
        admin.close()
    return points, finished


def sweep_header(config: GenTuneConfig) -> str:
    loads = ", ".join(f"{ld.users} streaming users" for ld in config.loads)
    return (
        f"Server {config.url}, model {config.model_name}, {time.strftime('%Y-%m-%d %H:%M')}. "
        f"Loads (closed loop): {loads}. Workload: {config.workload.describe()}. "
        f"{config.duration_s:g} s measured per point after {config.warmup_s:g} s of warm-up"
        + (f"; medians of {config.repeats} runs." if config.repeats > 1 else ".")
    )


def tune(config: GenTuneConfig) -> int:
    """Run the sweep with a progress bar; print the winners; 0 when finished, 130 interrupted."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from loadtest.genchoice import choose, medians, recommend

    console = Console(stderr=True)
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("sweeping", total=None)

        def on_point(point: GenPoint, done: int, total: int) -> None:
            progress.update(bar, advance=1, total=total)
            progress.console.print(
                f"{point.load:>6} {point.label:>40}: {point.tokens_per_s:7.1f} tok/s  TTFT p95 "
                f"{point.ttft_p95_ms or 0:6.0f} ms  TPOT p95 {point.tpot_p95_ms or 0:5.0f} ms  "
                f"failures {point.failures}/{point.streams}",
                highlight=False,
            )

        points, finished = run_sweep(
            config,
            on_point=on_point,
            on_plan=lambda n: progress.update(bar, total=n),
            header=sweep_header(config),
        )
    if not points:
        console.print("[red]interrupted before any point was measured[/red]")
        return 130
    points = medians(points)
    for choice in choose(points, config.targets):
        console.print(f"load {choice.load}: [bold]{choice.winner.label}[/bold] ({choice.note})")
    console.print(f"recommended: {recommend(points, config.targets)[2]}", highlight=False)
    if not finished:
        console.print("[yellow]interrupted: the files hold the runs measured[/yellow]")
    console.print(
        f"wrote {config.out}/results.csv, runs.csv, report.md, {PLOT}, recommended.toml",
        highlight=False,
    )
    return 0 if finished else 130


def default_model(url: str) -> str:
    """The first generating model the server lists (``GET /v1/models``, OpenAI's list)."""
    try:
        listed = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=30).json()
        return str(listed["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(
            f"{url} lists no generating model at GET /v1/models; pass --model-name"
        ) from None


def tune_generation(
    *,
    url: str,
    out: Path,
    model_name: str,
    loads: str,
    timeouts: str,
    running: str | None,
    budgets: str,
    workload: Path | None,
    prompt_tokens: str | None,
    max_tokens: str | None,
    duration_s: float,
    warmup_s: float,
    ttft_p95_ms: float | None,
    tpot_p95_ms: float | None,
    repeats: int,
    admin_token: str | None,
) -> int:
    """``shardserve tune --generate``: its options checked, then the sweep."""
    levels = parse_loads(loads)
    if any(level.target_rps for level in levels):
        raise ValueError("--generate takes user counts for --loads (closed loop), not rates")
    for name, target in (("--ttft-p95-ms", ttft_p95_ms), ("--tpot-p95-ms", tpot_p95_ms)):
        if target is not None and not target > 0:
            raise ValueError(f"{name} must be above 0, got {target:g}")
    config = GenTuneConfig(
        url=url,
        model_name=model_name or default_model(url),
        out=out,
        workload=load_workload(workload, prompt_tokens=prompt_tokens, max_tokens=max_tokens),
        loads=levels,
        timeouts=parse_timeouts(timeouts),
        running=parse_running(running),
        budgets=parse_budgets(budgets),
        duration_s=duration_s,
        warmup_s=warmup_s,
        targets=Targets(ttft_p95_ms, tpot_p95_ms),
        repeats=repeats,
        admin_token=admin_token,
    )
    return tune(config)
