"""The lifespan's jobs: load the model and start the batcher, warm up, poll the stage stats."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable

import numpy as np

from serving.batching.batcher import Batcher
from serving.server.metrics import memory_figures
from serving.server.runner import ModelRunner
from serving.server.state import RunnerFactory, ServerState, policy_from_settings
from shards.errors import one_line
from shards.partition.memory import format_size

log = logging.getLogger("shardserve")
# The stats poll is also the replicas' health check between batches, and it brings the
# stages' compute per batch size to the batching policy: often enough to follow a load change.
STATS_PERIOD_S = 2.0
# While loading, how often /readyz's account of what the load waits for is refreshed.
WAITS_PERIOD_S = 1.0


def describe_error(exc: BaseException) -> str:
    """One line for clients: the root cause of a remote (Ray) error, never its traceback."""
    cause = getattr(exc, "cause", None)
    return one_line(cause if isinstance(cause, BaseException) else exc)


async def load_model(
    state: ServerState, factory: RunnerFactory, on_failure: Callable[[str], None] | None
) -> None:
    """Load, start the batcher and warm up within ``load_timeout_s``; meanwhile keep
    ``state.load_waiting`` saying what the load waits for. Any failure, the timeout included,
    becomes ``state.load_error`` (for ``/readyz``) and ``on_failure``: never a silent hang."""
    timeout_s = state.settings.load_timeout_s
    watcher = asyncio.create_task(_watch_waits(state))
    started: list[Batcher] = []
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            await _load(state, factory, started)
    except Exception as exc:
        if isinstance(exc, TimeoutError) and deadline.expired():
            # The last look of the watcher: the cancelled load has removed its placement groups
            # since, in the same step of the loop, so the watcher has not looked again.
            state.load_error = _timed_out(timeout_s, state.load_waiting)
            log.error("model failed to load: %s", state.load_error)
        else:
            state.load_error = describe_error(exc)
            log.exception("model failed to load")
        state.loaded.set()
        if on_failure is not None:
            on_failure(state.load_error)
    finally:
        watcher.cancel()
        state.load_waiting = None
        if state.batcher is None:  # failed or cancelled: its loop task must not outlive the load
            for batcher in started:
                await batcher.stop(drain=False)


async def _load(state: ServerState, factory: RunnerFactory, started: list[Batcher]) -> None:
    runner = await factory(state.settings)
    state.runner = runner
    state.loaded.set()
    batcher = Batcher(
        runner.run_batch,
        policy_from_settings(state.settings, runner),
        on_batch=state.metrics.observe_batch,
        on_reject=lambda reason: state.metrics.rejects.labels(reason).inc(),
    )
    await batcher.start()
    started.append(batcher)
    state.metrics.bind_gauges(
        lambda: batcher.queued_rows,
        lambda: batcher.inflight_batches,
        lambda: batcher.effective_wait_ms,
    )
    state.metrics.bind_health(runner.health)
    await _warm_up(runner)
    await _log_memory(state, runner)
    state.batcher = batcher
    state.accepting = True
    state.ready.set()
    log.info("ready: serving %r (%d stage(s))", state.settings.served_name(), runner.num_stages)


async def _watch_waits(state: ServerState) -> None:
    """Ask Ray what this process's placement groups wait for, every ``WAITS_PERIOD_S``.

    ``shards.cluster`` (it imports Ray) is looked up, not imported: the real runner imports it
    while it loads, and a server on another runner (the tests' fakes) has no Ray to ask."""
    while True:
        await asyncio.sleep(WAITS_PERIOD_S)
        runtime = sys.modules.get("shards.cluster")
        if runtime is None:
            continue
        try:
            waiting = await asyncio.to_thread(runtime.pending_placement)
        except Exception:  # a GCS hiccup must not end the load; the next look may work
            log.debug("could not read the pending placement groups", exc_info=True)
            continue
        state.load_waiting = waiting


def _timed_out(timeout_s: float, waiting: str | None) -> str:
    message = f"the model did not load within load_timeout_s={timeout_s:g} s"
    if waiting:
        return f"{message} ({waiting}); free or add those resources, or raise load_timeout_s"
    return f"{message}; the server log says how far it got; raise load_timeout_s if it needs longer"


async def _warm_up(runner: ModelRunner) -> None:
    """One batch end to end, so the first user request does not pay for connection set-up."""
    inputs = {
        spec.name: np.zeros((1, *(d or 1 for d in spec.shape)), dtype=spec.np_dtype)
        for spec in runner.signature.inputs
    }
    await runner.run_batch(inputs)


async def _log_memory(state: ServerState, runner: ModelRunner) -> None:
    """One line per stage actor: the memory plan beside what the actor holds; the same figures
    go to /metrics (shardserve_stage_memory_bytes) from here on."""
    try:
        rows = await runner.stats()
    except Exception:
        log.warning("could not read the stage actors' memory", exc_info=True)
        return
    state.metrics.set_stage_stats(rows)
    for row in rows:
        figures = memory_figures(row.get("memory"))
        if "planned" not in figures or "measured" not in figures:
            continue
        planned, measured = figures["planned"], figures["measured"]
        gpu = ""
        if "gpu_measured_peak" in figures:
            gpu = f", GPU peak {format_size(figures['gpu_measured_peak'])}"
        log.info(
            "stage %s (replica %s) memory: planned peak %s, measured RSS %s (%.2fx the plan; "
            "process peak %s)%s",
            row.get("stage_index"),
            row.get("replica", 0),
            format_size(planned),
            format_size(measured),
            measured / planned if planned else 0.0,
            format_size(figures.get("measured_peak", 0)),
            gpu,
        )


async def poll_stage_stats(state: ServerState) -> None:
    while True:
        runner = state.runner
        if runner is not None:
            with contextlib.suppress(Exception):
                stats = await runner.stats()
                state.metrics.set_stage_stats(stats)
                if state.batcher is not None:
                    state.batcher.observe_compute(stats)
        await asyncio.sleep(STATS_PERIOD_S)
