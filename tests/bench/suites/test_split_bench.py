"""``python -m bench split``'s byte count, on the routed and the dense lookup combine of the demo
recommender's split item table: a routed part writes its share of the ids' vectors and their
positions, a dense part the whole lookup."""

from __future__ import annotations

from pathlib import Path

from bench.suites.split import _crossing
from shards.partition.cut import partition_to_bundle
from shards.partition.demo_models import demo_recommender
from tests.shards.partition.test_layer_split import BUDGET


def test_a_routed_part_is_counted_at_its_share_of_the_ids(tmp_path: Path) -> None:
    model = demo_recommender()
    found = {}
    for combine in ("dense", "routed"):
        manifest = partition_to_bundle(
            model,
            tmp_path / combine,
            max_stage_bytes=BUDGET,
            plan_batch_rows=8,
            device_overhead_bytes=0,
            lookup_combine=combine,
        )
        found[combine] = _crossing(manifest.stages, 8)
    # Dense: each of 2 parts writes the history's [8, 20, 32] and the item's [8, 1, 32] float32.
    assert found["dense"]["parts_written"] == 2 * (8 * 20 + 8) * 32 * 4
    # Routed: half the ids each (uniform ids), a 128-byte vector and a 4-byte position an id.
    assert found["routed"]["parts_written"] == 2 * (80 * 132 + 4 * 132)
    # What the parts write, the combine reads: the routed layout moves less both ways.
    assert found["routed"]["read"] < found["dense"]["read"]
