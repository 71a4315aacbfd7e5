"""``python -m bench split``'s byte counts and summary: a routed part is counted at its share
of the ids, an object is classed as Ray carries it (inline under 100 KiB, else the shared
store), a paired MLP part writes the output's width where an unpaired fc1 part writes its hidden
units, and the medians and ratios are taken round by round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.suites.split.crossing import INLINE_MAX, crossing
from bench.suites.split.models import build_mlp
from bench.suites.split.report import render
from bench.suites.split.run import LAYOUTS, summarise
from shards.partition.cut import partition_to_bundle
from shards.partition.demo_models import demo_recommender
from tests.shards.partition.test_layer_split import BUDGET


def _tables(tmp_path: Path, batch: int) -> dict[str, dict[str, int]]:
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
        found[combine] = {str(b): crossing(manifest.stages, b) for b in (8, batch)}
    return {f"{c}@{b}": v for c, by in found.items() for b, v in by.items()}


def test_a_routed_part_is_counted_at_its_share_of_the_ids_and_by_how_ray_carries_it(
    tmp_path: Path,
) -> None:
    found = _tables(tmp_path, 64)
    # Dense: each of 2 parts writes the history's [8, 20, 32] and the item's [8, 1, 32] float32.
    assert found["dense@8"]["parts_written"] == 2 * (8 * 20 + 8) * 32 * 4
    # Routed: half the ids each (uniform ids), a 128-byte vector and a 4-byte position an id.
    assert found["routed@8"]["parts_written"] == 2 * (80 * 132 + 4 * 132)
    # What the parts write, the combine reads: the routed layout moves less both ways.
    assert found["routed@8"]["read"] < found["dense@8"]["read"]
    # At 64 rows a dense part's history lookup (160 KiB) goes through the store, a routed
    # part's (80 KiB of vectors, 2.5 KiB of positions) is passed inline.
    dense, routed = found["dense@64"], found["routed@64"]
    assert 64 * 20 * 32 * 4 >= INLINE_MAX > 640 * 132
    assert dense["store"] - routed["store"] == 2 * 64 * 20 * 32 * 4
    # The rest is the same both ways (the scores' [64, 1000] float32 and the ids put once).
    assert dense["inline"] + dense["store"] > routed["inline"] + routed["store"]


def test_a_paired_part_writes_the_outputs_width_an_unpaired_one_its_hidden_units(
    tmp_path: Path,
) -> None:
    width, hidden, batch = 64, 2048, 4
    fc1 = width * hidden * 4
    found = {}
    for pair in (True, False):
        manifest = partition_to_bundle(
            build_mlp(width, hidden),
            tmp_path / str(pair),
            max_stage_bytes=int(fc1 * 0.6),
            plan_batch_rows=batch,
            device_overhead_bytes=0,
            pair_dense=pair,
        )
        parts = [s for s in manifest.stages if s.part]
        found[pair] = (manifest.depth, len(parts), crossing(manifest.stages, batch))
    (depth, parts, paired), (depth_unpaired, _, unpaired) = found[True], found[False]
    assert (depth, depth_unpaired) == (2, 4)
    # Each paired part: its partial sum of fc2's [batch, width].
    assert paired["parts_written"] == parts * batch * width * 4
    # Unpaired: fc1's parts write the hidden units, fc2's parts their slices of the width.
    assert unpaired["parts_written"] == batch * (hidden + width) * 4


def _round(rows: dict[str, float]) -> dict[str, Any]:
    actor = {"stage": "0", "planned": 100, "rss": 310, "rss_peak": 320, "tf_mark": 180, "shm": 10}
    return {
        name: {
            "stages": ["0"],
            "rows_per_s": r,
            "p50_ms": 1000 / r,
            "p99_ms": 2000 / r,
            "alone_p50_ms": 1.0,
            "store_bytes": r,
            "store_objects": 1.0,
            "load": [1.0, 2.0],
            "actors": [{**actor, "weights": 50}],
            "crossing": {"read": 1, "written": 1, "parts_written": 0, "store": 4, "inline": 1},
        }
        for name, r in rows.items()
    }


def test_the_summary_takes_medians_and_each_rounds_ratio() -> None:
    names = [layout.name for layout in LAYOUTS["mlp"]]
    # The load doubles in round 2: the absolute figures move, the ratios do not.
    rounds = [
        _round(dict(zip(names, (100.0, 50.0, 25.0), strict=True))),
        _round(dict(zip(names, (200.0, 100.0, 50.0), strict=True))),
        _round(dict(zip(names, (400.0, 200.0, 100.0), strict=True))),
    ]
    found = summarise("mlp", rounds)
    assert found["layouts"]["one stage"]["rows_per_s"] == 200.0
    assert found["over_one"]["split, paired"]["rows_per_s"] == 0.5
    assert found["versus"]["rows_per_s"] == 2.0
    assert found["versus"]["computed_store"] == 1.0
    text = render(
        {
            "batch": 64,
            "repeats": 3,
            "models": {"mlp": {"layer_bytes": 2**27, "budget": 2**26, "rounds": rounds, **found}},
        }
    )
    # RSS above the TF import, less the store's shared pages, against the plan: (310 - 10 -
    # 180) / 100.
    assert "| one stage | 0 | 0.0 | 0.0 | 0 | 0 | 0 | 1.20x | 1.40x |" in text
    assert "split, paired / split, unpaired: store bytes measured 2.00x" in text


def test_the_tied_bench_counts_a_process_that_runs_two_stages_once() -> None:
    from bench.suites.split.tied import processes

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
