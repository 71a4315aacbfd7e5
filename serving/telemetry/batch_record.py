"""What one batch did, as the batcher reports it to its ``on_batch`` callback (the metrics).

Here, at the bottom of ``serving`` beside the stamps, so that the batcher reports down to it and
its reader (``serving.metrics.series``) needs nothing of the batcher.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRecord:
    size: int
    padded_size: int
    reason: str  # "full" | "timeout" | "flush" | "idle" | "target"
    queue_wait_s: float
    run_s: float
    ok: bool  # every row answered by the first run
    isolated: int = 0  # requests failed alone after splitting the batch to find them
    # Length padding (0 and 0 without it): the rows' real positions (their lengths summed), and
    # the positions padding added to reach the batch's length bucket: the waste.
    positions: int = 0
    padded_positions: int = 0
