"""One server log line whenever a stage actor reports a (rows, length) shape it had not run before.

The actors keep their compute per shape (``shards.actor.compute_log``) and log new shapes in
their own process, where Ray drops INFO lines; the server reads the same shapes from the stats
poll and logs them here, where operators look. Few shapes is length padding at work; a growing
list means requests of many lengths reach the model unpadded, each shape its own kernels.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("shardserve")


def _shape(key: str) -> tuple[int, int]:
    rows, _, length = key.partition(",")
    return int(rows), int(length or 0)


class ShapeLog:
    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], set[tuple[int, int]]] = {}

    def observe(self, stage_stats: list[dict[str, Any]]) -> None:
        """Log the shapes each (replica, stage) reports for the first time."""
        for report in stage_stats:
            shapes = report.get("compute_by_shape")
            if not isinstance(shapes, dict):
                continue
            where = (int(report.get("replica", 0)), int(report.get("stage_index", 0)))
            seen = self._seen.setdefault(where, set())
            new = sorted({_shape(str(key)) for key in shapes} - seen)
            if not new:
                continue
            seen.update(new)
            log.info(
                "stage %d (replica %d) ran new shape(s) %s; %d distinct (rows x length) so far",
                where[1],
                where[0],
                ", ".join(f"{rows}x{length}" if length else f"{rows} rows" for rows, length in new),
                len(seen),
            )
