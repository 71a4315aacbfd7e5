"""Running one batch and answering its requests, and finding the poison rows when it fails.

When the model fails on the input (``ModelInputError``), the batch is split by request and the
halves rerun, down to single requests, so that only the requests that trigger the error get it
and their batch-mates are answered. Pure asyncio: the batcher passes its runner and its way of
failing requests.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from serving.batching.rows import Segment, assemble, check_outputs, deliver
from serving.batching.settings import BatchSettings
from serving.errors import BatchFailedError, ModelInputError, ShardServeError, from_runner

log = logging.getLogger("shardserve")

RunBatch = Callable[[dict[str, np.ndarray]], Awaitable[dict[str, np.ndarray]]]
FailSegments = Callable[[list[Segment], ShardServeError], None]


@dataclass
class Outcome:
    clean: bool = True  # every row answered by the first run
    isolated: int = 0  # requests failed alone after splitting the batch to find them


def isolation_depth(segments: list[Segment]) -> int:
    """Halving the batch's requests this many times leaves one request per batch."""
    return max(0, math.ceil(math.log2(max(1, len(segments)))))


async def settle(
    run_batch: RunBatch,
    segments: list[Segment],
    policy: BatchSettings,
    depth: int,
    outcome: Outcome,
    fail: FailSegments,
) -> None:
    """Run the segments as one batch and answer their requests. When the model fails on the
    input, split the batch by request and rerun the halves (at most ``depth`` times)."""
    rows = sum(count for _, _, count in segments)
    padded = policy.padded_size(rows)
    try:
        raw = await run_batch(assemble(segments, rows, padded))
        ids = [r.request_id for r, _, _ in segments if r.request_id]
        outputs = check_outputs(raw, rows, padded, ids)
    except Exception as exc:
        error = from_runner(exc, rows)
        outcome.clean = False
        live = [s for s in segments if not s[0].future.done()]
        if isinstance(error, ModelInputError) and len(live) > 1 and depth > 0:
            half = len(live) // 2
            await asyncio.gather(
                settle(run_batch, live[:half], policy, depth - 1, outcome, fail),
                settle(run_batch, live[half:], policy, depth - 1, outcome, fail),
            )
            return
        if isinstance(error, ModelInputError):
            if len(live) > 1:  # not isolated: the error is no single request's
                error = BatchFailedError(f"the model failed on a batch of {rows} rows")
            else:
                outcome.isolated += len(live)
        ids = [r.request_id for r, _, _ in live if r.request_id]
        who = ",".join(ids) or "-"
        log.warning("batch of %d rows failed for request(s) %s: %s", rows, who, error.message)
        fail(live, error)
        return
    deliver(segments, outputs)
