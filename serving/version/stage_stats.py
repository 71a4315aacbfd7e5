"""What a served version reads of its stage actors (``runner.stats()``): the memory line per
stage once it is loaded, and the stats poll from then on.

The poll is also the replicas' health check between batches (a replica that lost an actor
leaves the rotation before a batch fails on it), and it brings the stages' compute per batch
size to the batching policy and the shapes they ran to the shape log.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from serving.metrics.series import memory_figures
from shards.partition.memory_plan import format_size

if TYPE_CHECKING:
    from serving.batching.batcher import Batcher
    from serving.metrics.series import ModelMetrics
    from serving.version.runner import ModelRunner
    from serving.version.shape_log import ShapeLog

__all__ = ["STATS_PERIOD_S", "STATS_TIMEOUT_S", "log_memory", "memory_line", "poll_stats"]

log = logging.getLogger("shardserve")
# Often enough to follow a load change.
STATS_PERIOD_S = 2.0
# A stage actor that hangs (not dead) would hold the poll, and with it the health check, for ever;
# a poll that takes longer is dropped and the next one tried.
STATS_TIMEOUT_S = 10.0


class Polled(Protocol):
    """What the poll reads and feeds of a served version (``ServedModel``)."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def runner(self) -> ModelRunner | None: ...
    @property
    def batcher(self) -> Batcher | None: ...
    @property
    def metrics(self) -> ModelMetrics: ...
    @property
    def shapes(self) -> ShapeLog: ...


async def poll_stats(model: Polled) -> None:
    """Every ``STATS_PERIOD_S`` once ``model`` has a runner; a poll that hangs is dropped (logged
    when a run of them begins); any other error ends the loop, which ``supervise`` logs and
    starts again."""
    hanging = False
    while True:
        runner = model.runner
        if runner is not None:
            try:
                async with asyncio.timeout(STATS_TIMEOUT_S):
                    stats = await runner.stats()
            except TimeoutError:
                if not hanging:
                    log.warning(
                        "model %r version %s: its stage actors did not report their stats "
                        "within %g s (a stage that hangs?); trying every %g s",
                        model.name,
                        model.version,
                        STATS_TIMEOUT_S,
                        STATS_PERIOD_S,
                    )
                hanging = True
            else:
                hanging = False
                model.metrics.set_stage_stats(stats)
                model.shapes.observe(stats)
                if model.batcher is not None:
                    model.batcher.observe_compute(stats)
        await asyncio.sleep(STATS_PERIOD_S)


async def log_memory(model: Polled, runner: ModelRunner) -> None:
    """One line per stage actor: the memory plan beside what the actor holds; the same
    figures go to /metrics (shardserve_stage_memory_bytes) from here on."""
    try:
        rows = await runner.stats()
    except Exception:
        log.warning("could not read the stage actors' memory", exc_info=True)
        return
    model.metrics.set_stage_stats(rows)
    for row in rows:
        line = memory_line(row)
        if line is not None:
            log.info("%s", line)


def memory_line(row: dict[str, object]) -> str | None:
    figures = memory_figures(row.get("memory"))
    if "planned" not in figures or "measured" not in figures:
        return None
    planned, measured = figures["planned"], figures["measured"]
    gpu = ""
    if "gpu_measured_peak" in figures:
        gpu = f", GPU peak {format_size(figures['gpu_measured_peak'])}"
    return (
        f"stage {row.get('stage', row.get('stage_index'))} (replica {row.get('replica', 0)}) "
        "memory: planned peak "
        f"{format_size(planned)}, measured RSS {format_size(measured)} "
        f"({measured / planned if planned else 0.0:.2f}x the plan; process peak "
        f"{format_size(figures.get('measured_peak', 0))}){gpu}"
    )
