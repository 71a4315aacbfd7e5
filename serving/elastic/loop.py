"""The interim driver of a version's scale steps, until the reconciler takes them on its ticks.

``run_scaling`` is one of a ``ServedModel``'s jobs: from READY until the version's jobs end
(``ServedModel.stop_jobs``) it calls ``serving.elastic.steps.observe`` and ``scale_step`` every
``SCALE_PERIOD_S`` and runs each step as a task of its own (``run_step``); when it ends, the steps
under way are cancelled. The reconciler (``serving.repository.reconciler``) replaces it: it calls
the same two functions on each tick, and this module goes.

The other names here are those its callers import from it today (``serving.version.served``,
``serving.server.state``, ``serving.repository.replica_switch``); they live in
``serving.elastic.steps``, ``serving.elastic.start_count`` and ``serving.version.scale_state``.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from serving.elastic.start_count import inherit_count, serving_count, start_count
from serving.elastic.steps import (
    RETRY_S,
    Scaler,
    hold,
    observe,
    release,
    run_step,
    scale_step,
    scaler_of,
)
from serving.version.scale_state import ScaleStatus

if TYPE_CHECKING:
    from serving.version.served import ServedModel

__all__ = [
    "RETRY_S",
    "SCALE_PERIOD_S",
    "ScaleStatus",
    "Scaler",
    "hold",
    "inherit_count",
    "release",
    "run_scaling",
    "serving_count",
    "start_count",
]

# How often the version is sampled: the delays (seconds to a minute) are counted in these.
SCALE_PERIOD_S = 1.0


async def run_scaling(model: ServedModel, period_s: float = SCALE_PERIOD_S) -> None:
    """``model``'s scale steps, from READY until cancelled (the interim driver: the reconciler
    replaces it)."""
    await model.until_ready()
    scaler = scaler_of(model)
    if scaler is None:  # a count that never changes
        return
    try:
        while True:
            observe(model, time.monotonic())
            step = scale_step(model)
            if step is not None:
                run_step(model, step)
            await asyncio.sleep(period_s)
    finally:
        scaler.cancel()
