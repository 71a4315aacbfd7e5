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


def test_the_tied_bench_counts_a_process_that_runs_two_stages_once() -> None:
    from bench.suites.split_tied import processes

    def actor(stage: str, pid: int, weights: int) -> dict[str, object]:
        return {
            "stage": stage,
            "pid": pid,
            "rss": 900,
            "tf_mark": 800,
            "weights": weights,
            "process_weights": weights,
        }

    # Held once: stage 0.0 (the host, its process's weights) and 2.0 (its guest, none of its
    # own) are one process; stage 1 is no part.
    found = processes([actor("0.0", 7, 64), actor("1", 8, 1), actor("2.0", 7, 0)])
    assert [(p["stages"], p["weights"], p["part"]) for p in found] == [
        (["0.0", "2.0"], 64, True),
        (["1"], 1, False),
    ]
