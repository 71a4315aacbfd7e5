"""Running one batch and answering its requests, and finding the poison rows when it fails.

A batch's segments are stacked into one array per input (padded with a real row), run, and the
model's answer checked and cut back into each request's rows. When the model fails on the input
(``ModelInputError``), the batch is split by request and the halves rerun, down to single
requests, so that only the requests that trigger the error get it and their batch-mates are
answered. Pure asyncio and numpy: the batcher passes its runner and its way of failing requests.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from serving.errors import (
    BatchFailedError,
    ModelInputError,
    RecoveringError,
    ShardServeError,
    from_runner,
)
from serving.telemetry import active

if TYPE_CHECKING:
    from serving.batching.lengths import LengthPadding
    from serving.batching.rows import Segment
    from serving.batching.settings import BatchSettings

log = logging.getLogger("shardserve")

RunBatch = Callable[[dict[str, np.ndarray]], Awaitable[dict[str, np.ndarray]]]
FailSegments = Callable[[list["Segment"], ShardServeError], None]


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
    lengths: LengthPadding | None = None,
) -> None:
    """Run the segments as one batch and answer their requests. When the model fails on the
    input, split the batch by request and rerun the halves (at most ``depth`` times)."""
    rows = sum(count for _, _, count in segments)
    padded = policy.padded_size(rows)
    try:
        raw = await run_batch(assemble(segments, rows, padded, lengths))
        ids = [r.request_id for r, _, _ in segments if r.request_id]
        outputs = check_outputs(raw, rows, padded, ids)
    except Exception as exc:
        error = from_runner(exc, rows)
        outcome.clean = False
        live = [s for s in segments if not s[0].future.done()]
        splitting = isinstance(error, ModelInputError) and len(live) > 1 and depth > 0
        tracer = active.tracer
        if tracer is not None:
            tracer.batch_failed(error.message, rows, splitting)
        if splitting:
            half = len(live) // 2
            await asyncio.gather(
                _rerun(run_batch, live[:half], policy, depth - 1, outcome, fail, lengths),
                _rerun(run_batch, live[half:], policy, depth - 1, outcome, fail, lengths),
            )
            return
        if isinstance(error, ModelInputError):
            if len(live) > 1:  # not isolated: the error is no single request's
                error = BatchFailedError(f"the model failed on a batch of {rows} rows")
            else:
                outcome.isolated += len(live)
        if not isinstance(error, RecoveringError):  # held, not failed (``serving.batching.hold``)
            ids = [r.request_id for r, _, _ in live if r.request_id]
            who = ",".join(ids) or "-"
            log.warning("batch of %d rows failed for request(s) %s: %s", rows, who, error.message)
        fail(live, error)
        return
    deliver(segments, outputs, lengths)


async def _rerun(
    run_batch: RunBatch,
    segments: list[Segment],
    policy: BatchSettings,
    depth: int,
    outcome: Outcome,
    fail: FailSegments,
    lengths: LengthPadding | None,
) -> None:
    """``settle`` of half a failed batch: in a span of its own where the batch is traced."""
    tracer = active.tracer
    if tracer is None:
        await settle(run_batch, segments, policy, depth, outcome, fail, lengths)
        return
    with tracer.rerun(segments):
        await settle(run_batch, segments, policy, depth, outcome, fail, lengths)


def batch_length(segments: list[Segment], lengths: LengthPadding | None) -> int:
    """The length a batch of ``segments`` is padded to: the bucket of its longest request; 0
    without length padding."""
    if lengths is None:
        return 0
    return lengths.bucket(max(request.length for request, _, _ in segments))


def assemble(
    segments: list[Segment], rows: int, padded: int, lengths: LengthPadding | None = None
) -> dict[str, np.ndarray]:
    """Stack the segments' rows per input, then repeat the last real row up to ``padded`` rows;
    with ``lengths``, each request's rows are first length padded to the batch's bucket.

    Repeating a real row (not zeros) keeps the padding inside the model's normal input range.
    """
    length = batch_length(segments, lengths)
    batch: dict[str, np.ndarray] = {}
    for name in segments[0][0].inputs:
        parts = [r.inputs[name][start : start + n] for r, start, n in segments]
        if lengths is not None and name in lengths.axes:
            batch[name] = lengths.stack(name, parts, length, padded)
            continue
        if padded > rows:
            parts.append(np.repeat(parts[-1][-1:], padded - rows, axis=0))
        batch[name] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    return batch


def check_outputs(
    outputs: Any, rows: int, padded: int, request_ids: Sequence[str] = ()
) -> dict[str, np.ndarray]:
    """The outputs cut to the real rows; a model answer of any other shape fails the batch.

    What the model returned goes to the log with ``request_ids``; clients get its type only (its
    repr may hold anything: paths, addresses, object ids)."""
    if not isinstance(outputs, Mapping) or not outputs:
        log.error(
            "model returned %s for request(s) %s: %.200r",
            type(outputs).__name__,
            ",".join(request_ids) or "-",
            outputs,
        )
        raise BatchFailedError(
            f"model returned {'an empty ' if isinstance(outputs, Mapping) else 'a '}"
            f"{type(outputs).__name__}; expected a non-empty dict of output name -> array"
        )
    checked: dict[str, np.ndarray] = {}
    for name, value in outputs.items():
        array = np.asarray(value)
        got = array.shape[0] if array.ndim else "no"
        if got not in (rows, padded):
            expected = f"{padded}" if padded == rows else f"{padded} (or the {rows} real rows)"
            raise BatchFailedError(
                f"model returned {got} rows for output {name!r} on a batch of {rows} rows "
                f"padded to {padded}; expected {expected}"
            )
        checked[str(name)] = array[:rows]
    return checked


def deliver(
    segments: list[Segment],
    outputs: dict[str, np.ndarray],
    lengths: LengthPadding | None = None,
) -> None:
    """Hand each request its rows of a batch's outputs, cut back to its own length."""
    offset = 0
    for request, start, count in segments:
        part = {k: v[offset : offset + count] for k, v in outputs.items()}
        if lengths is not None:
            part = lengths.cut(part, request.length)
        request.add_outputs(start, part)
        offset += count
