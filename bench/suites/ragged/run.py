"""``python -m bench ragged``: rows of different lengths batched together (issue 19).

Per model (``--models``: the token model and a keras_hub BERT encoder, ``--stages`` each), three
servers, one after the other, ``--max-sequence-length`` at ``--max-length`` and the default
length buckets:

1. **length padded** (the default), ``--batch-timeout-ms``: ``--clients`` closed-loop clients,
   each request one row, uniform rows of ``--max-length`` tokens and mixed rows of lengths
   uniform in ``--min-length``..``--max-length`` (seeded), in the same run, the order alternated
   each repeat; then an exactness sample (``--sample`` rows of mixed lengths, sent together so
   that they share batches, then one at a time) against the saved model's answer to each row
   alone.
2. **length padded, ``--batch-timeout-ms auto``** (the cost model choosing batch sizes): the
   mixed load, on a server of its own started with the flag, as a user would run it.
3. **--no-pad-lengths**: one queue per length, exactly the behaviour before issue 19; the same
   mixed load, and the sample sent together.

The waste is the pad positions per real position of the batches, from ``/metrics``
(``shardserve_padded_positions_total``). Then ``--unsafe-model`` (an unmasked Conv1D model,
whose output changes under length padding), served as it is (no input has a pad value) and with
``--pad-input NAME=0``, where the warm-up's check must find that padding changes its answers:
both times it must be served unpadded, and exactly; what its V2 metadata and log say is kept.
The servers and their Ray run on the first core, the load generator on the second (``--pin``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import options
from bench.load import pyload
from bench.models.ragged import (
    MODELS,
    Answer,
    RaggedModel,
    Row,
    body,
    expected_answers,
    get_model,
    lengths,
    rows,
    save_model,
)
from bench.observe.quiet import other_benches
from bench.observe.scrape import base_url, batches_and_rows, free_port, mean_batch_rows, scrape
from bench.options import Progress
from bench.suites.looplag import pin_argv, pinned
from bench.suites.ragged.check import (
    ask,
    length_padding_lines,
    max_abs_diff,
    model_metadata,
    positions,
)
from bench.suites.ragged.report import render
from bench.systems import ServerProcess, SystemConfig
from bench.systems.shardserve import shardserve_spec


@dataclass(frozen=True)
class RaggedPlan:
    models: tuple[str, ...] = ("demo-tokens", "bert")
    unsafe_model: str = "demo-conv1d"  # "": not checked
    stages: int = 2
    clients: int = 32
    min_length: int = 8
    max_length: int = 128
    max_batch_size: int = 32
    batch_timeout_ms: float = 5.0
    seconds: float = 12.0
    warmup_s: float = 3.0
    repeats: int = 1
    sample: int = 32
    bodies: int = 512  # distinct requests each load cycles through
    seed: int = 0
    pin: bool = len(os.sched_getaffinity(0)) >= 2
    workdir: Path = Path(".bench/ragged")

    def __post_init__(self) -> None:
        options.require(
            self,
            at_least_one=("stages", "clients", "max_batch_size", "repeats", "sample", "bodies"),
            positive=("seconds", "warmup_s"),
        )
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(
                f"lengths need 1 <= --min-length <= --max-length, got "
                f"{self.min_length}..{self.max_length}"
            )
        for name in (*self.models, *([self.unsafe_model] if self.unsafe_model else [])):
            get_model(name)


def run(plan: RaggedPlan, progress: Progress = print) -> dict[str, Any]:
    results: dict[str, Any] = {
        "bench": "ragged",
        "plan": options.plan_json(plan),
        "models": {},
        "unsafe": None,
        "other_benches": other_benches(),
    }
    for name in plan.models:
        results["models"][name] = run_model(plan, get_model(name), progress)
    if plan.unsafe_model:
        results["unsafe"] = run_unsafe(plan, get_model(plan.unsafe_model), progress)
    return results


def _mixed_lengths(plan: RaggedPlan, n: int, seed: int) -> list[int]:
    return lengths(n, plan.min_length, plan.max_length, seed)


def _server(
    plan: RaggedPlan,
    model: RaggedModel,
    path: Path,
    label: str,
    *,
    extra: tuple[str, ...] = (),
    timeout: float | str | None = None,
) -> ServerProcess:
    port = free_port()
    wait = plan.batch_timeout_ms if timeout is None else timeout
    config = SystemConfig(path, port, plan.max_batch_size, wait)
    flags = {"--max-sequence-length": str(plan.max_length), "--grpc-port": "0"}
    spec = shardserve_spec(config, plan.stages, plan.workdir / "cache", flags=flags)
    argv = [*pin_argv(plan.pin), *spec.argv, *extra]
    ready = body(rows(model, [plan.min_length], plan.seed))
    return ServerProcess(replace(spec, argv=argv), port, ready, _log(plan, model, label))


def _log(plan: RaggedPlan, model: RaggedModel, label: str) -> Path:
    return plan.workdir / "logs" / f"{model.name}-{label}.log"


def _measured(
    server: ServerProcess, bodies: list[bytes], plan: RaggedPlan, **labels: Any
) -> dict[str, Any]:
    base = base_url(server.url)
    before = scrape(base)
    result = pyload.run(server.url, bodies, ["--concurrency", str(plan.clients)], plan.seconds)
    after = scrape(base)
    return {
        **labels,
        **result.to_json(),
        "mean_batch_rows": mean_batch_rows(after, before),
        "positions": positions(after, before),
        "loadavg_1min": os.getloadavg()[0],
    }


def _say(progress: Progress, name: str, record: dict[str, Any]) -> None:
    counted = record["positions"]
    progress(
        f"  [{name}] {record['variant']:>8} {record['load']:>7} r{record['repeat']}: "
        f"{record['rps']:.1f} req/s p50 {record['p50_ms']:.1f} p99 {record['p99_ms']:.1f} ms, "
        f"{record['mean_batch_rows']:.1f} rows/batch, positions real {counted['real']:.0f} "
        f"pad {counted['pad']:.0f}, errors {record['errors']}, load {record['loadavg_1min']:.1f}"
    )


def _exactness(
    server: ServerProcess, sample: list[Row], expected: list[Answer], *, alone: bool
) -> dict[str, Any]:
    """The sample sent together (sharing batches) against each row alone through the model
    itself, and with ``alone`` also one at a time through the server."""
    base = base_url(server.url)
    before = scrape(base)
    batched = ask(server.url, sample, together=True)
    batches, _ = batches_and_rows(scrape(base), before)
    diff, problems = max_abs_diff(batched, expected)
    record: dict[str, Any] = {"rows": len(sample), "batches": batches, "batched_vs_model": diff}
    if alone:
        one_by_one = ask(server.url, sample, together=False)
        record["alone_vs_model"], more = max_abs_diff(one_by_one, expected)
        record["batched_vs_alone"], most = max_abs_diff(batched, one_by_one)
        problems += more + most
    record["problems"] = problems[:5]
    return record


def run_model(plan: RaggedPlan, model: RaggedModel, progress: Progress) -> dict[str, Any]:
    progress(f"[{model.name}] saving the model, the sample's answers row by row")
    path = save_model(model.name, plan.workdir)
    mixed_rows = rows(model, _mixed_lengths(plan, plan.bodies, plan.seed), plan.seed)
    mixed = [body([row]) for row in mixed_rows]
    uniform = [body([row]) for row in rows(model, [plan.max_length] * plan.bodies, plan.seed + 1)]
    sample = rows(model, _mixed_lengths(plan, plan.sample, plan.seed + 2), plan.seed + 2)
    expected = expected_answers(path, sample, plan.workdir / "expected" / model.name)
    runs: list[dict[str, Any]] = []
    exactness: dict[str, Any] = {}

    def measure(server: ServerProcess, variant: str, load: str, repeat: int) -> None:
        bodies = uniform if load == "uniform" else mixed
        record = _measured(server, bodies, plan, variant=variant, load=load, repeat=repeat)
        _say(progress, model.name, record)
        runs.append(record)

    progress(f"[{model.name}] length padded, {plan.batch_timeout_ms:g} ms")
    with _server(plan, model, path, "padded") as server, pinned(plan.pin):
        pyload.run(server.url, mixed, ["--concurrency", str(plan.clients)], plan.warmup_s)
        for repeat in range(plan.repeats):
            for load in ("uniform", "mixed") if repeat % 2 == 0 else ("mixed", "uniform"):
                measure(server, "padded", load, repeat)
        exactness["padded"] = _exactness(server, sample, expected, alone=True)
        progress(f"  [{model.name}] exactness, length padded: {exactness['padded']}")
    progress(f"[{model.name}] length padded, --batch-timeout-ms auto")
    with _server(plan, model, path, "auto", timeout="auto") as server, pinned(plan.pin):
        pyload.run(server.url, mixed, ["--concurrency", str(plan.clients)], plan.warmup_s)
        for repeat in range(plan.repeats):
            measure(server, "auto", "mixed", repeat)
    progress(f"[{model.name}] --no-pad-lengths (one queue per length, as before issue 19)")
    with (
        _server(plan, model, path, "unpadded", extra=("--no-pad-lengths",)) as server,
        pinned(plan.pin),
    ):
        pyload.run(server.url, mixed, ["--concurrency", str(plan.clients)], plan.warmup_s)
        for repeat in range(plan.repeats):
            measure(server, "unpadded", "mixed", repeat)
        exactness["unpadded"] = _exactness(server, sample, expected, alone=False)
        progress(f"  [{model.name}] exactness, unpadded: {exactness['unpadded']}")
    return {
        "about": model.about,
        "tolerance": model.tolerance,
        "runs": runs,
        "exactness": exactness,
    }


def run_unsafe(plan: RaggedPlan, model: RaggedModel, progress: Progress) -> dict[str, Any]:
    """A model length padding would change, served twice: as it is (it masks nothing, so no
    input has a pad value) and with ``--pad-input NAME=0`` for each input, where the warm-up's
    check must find that padding changes the answers. Both times: unpadded, and exact."""
    progress(f"[{model.name}] a model whose output changes under length padding")
    path = save_model(model.name, plan.workdir)
    sample = rows(model, _mixed_lengths(plan, plan.sample, plan.seed + 3), plan.seed + 3)
    expected = expected_answers(path, sample, plan.workdir / "expected" / model.name)
    servers: dict[str, Any] = {}
    extra: tuple[str, ...] = ()
    for label in ("as is", "pad-input"):
        with _server(plan, model, path, label.replace(" ", "-"), extra=extra) as server:
            base = base_url(server.url)
            metadata = model_metadata(base, model.name)
            before = scrape(base)
            exact = _exactness(server, sample, expected, alone=False)
            counted = positions(scrape(base), before)
        servers[label] = {
            "flags": list(extra),
            "parameters": metadata.get("parameters") or {},
            "log_lines": length_padding_lines(_log(plan, model, label.replace(" ", "-"))),
            "positions": counted,
            "exactness": exact,
        }
        progress(f"  [{model.name}] {label}: {servers[label]}")
        extra = tuple(f"--pad-input={spec['name']}=0" for spec in metadata.get("inputs", []))
    return {
        "name": model.name,
        "about": model.about,
        "tolerance": model.tolerance,
        "servers": servers,
    }


def add_parsers(sub: Any) -> None:
    about = "mixed vs uniform lengths, length padded vs one queue per length (issue 19)"
    opts = options.suite(
        sub, "ragged", about, out="docs/bench-ragged", plan=RaggedPlan, run=run, render=render
    )
    opts.add("models", help=f"comma-separated, of {', '.join(sorted(MODELS))}")
    opts.own("--unsafe-model", help="a model length padding changes ('' to skip)")
    opts.add("stages", "clients", "max_batch_size", "batch_timeout_ms")
    opts.own("--min-length", type=int)
    opts.own("--max-length", type=int, help="also the servers' --max-sequence-length")
    opts.add("seconds", "warmup_s", "repeats")
    opts.own("--sample", type=int, help="rows of the exactness check")
    opts.own("--bodies", type=int, help="distinct requests each load cycles through")
    opts.add("seed", "pin", "workdir")
