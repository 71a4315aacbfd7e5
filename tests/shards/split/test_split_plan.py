"""What the memory plan counts for a split layer's parts beyond their tensors' shapes (issue 42):
a routed lookup part's rows found at their worst case (every id of the batch in its range), and
a paired part's slice of the hidden activation, which never leaves it."""

from __future__ import annotations

import math
from pathlib import Path

from shards.partition.cut import partition_to_bundle
from shards.partition.demo_models import demo_recommender
from shards.sizes import row_bytes
from shards.split import pair_parts_needed, parts_needed
from tests.shards.partition.test_layer_split import BUDGET, MLP_BUDGET, mlp

HISTORY, ITEM, DIM = 20, 1, 32  # the recommender's item table: ids read per row, its width


def part_activations(tmp_path: Path, combine: str) -> list[int]:
    manifest = partition_to_bundle(
        demo_recommender(),
        tmp_path / combine,
        max_stage_bytes=BUDGET,
        plan_batch_rows=8,
        device_overhead_bytes=0,
        lookup_combine=combine,
    )
    return [s.memory.activation_bytes for s in manifest.stages if s.part and s.memory]


def test_a_routed_part_is_planned_as_if_it_found_every_id_of_the_batch(tmp_path: Path) -> None:
    ids = HISTORY + ITEM
    # Each part holds the ids it reads (int32) and writes, dense, every id's vector.
    dense = 8 * (ids * 4 + ids * DIM * 4)
    assert part_activations(tmp_path, "dense") == [dense, dense]
    # Routed, a part may find every id in its range: every vector, and 4 bytes of position
    # each (not one vector a row, as counted before: 8 x 21 x 132 bytes under).
    assert part_activations(tmp_path, "routed") == [dense + 8 * ids * 4] * 2


def test_a_paired_part_is_planned_with_its_slice_of_the_hidden_activation(tmp_path: Path) -> None:
    manifest = partition_to_bundle(
        mlp(),
        tmp_path / "b",
        max_stage_bytes=MLP_BUDGET,
        plan_batch_rows=4,
        device_overhead_bytes=0,
    )
    parts = [s for s in manifest.stages if s.part]
    assert [(p.part.start, p.part.stop) for p in parts if p.part] == [
        (0, 682),
        (682, 1365),
        (1365, 2048),
    ]
    for part in parts:
        assert part.part and part.memory
        units = part.part.stop - part.part.start
        # x (256) held, fc2's partial product (256) written, and fc1's units of the hidden
        # activation (682 or 683 floats a row), live inside the call.
        assert part.memory.activation_bytes == 4 * (256 + 256 + units) * 4


def test_the_rule_counts_a_pairs_hidden_slice_and_a_routed_parts_positions() -> None:
    model = mlp()
    fc1, fc2 = (model.get_layer(n)._inbound_nodes[0] for n in ("fc1", "fc2"))
    weights = sum(
        math.prod(w.shape) * 4 for n in ("fc1", "fc2") for w in model.get_layer(n).weights
    )
    # Three parts: a third of both layers' weights, and per row x, fc2's output and a third of
    # the hidden units (683 rounded up, 2 048 floats in all).
    need = math.ceil(weights / 3) + 4 * (256 * 4 + math.ceil(2048 * 4 / 3) + 256 * 4)
    assert pair_parts_needed(fc1, fc2, weights, 0, 4, 1, need) == 3
    assert pair_parts_needed(fc1, fc2, weights, 0, 4, 1, need - 1) == 4

    table = demo_recommender().get_layer("items")
    calls = table._inbound_nodes
    held = sum(row_bytes(tuple(n.input_tensors[0].shape), "int32")[0] for n in calls)
    out = (HISTORY + ITEM) * DIM * 4
    weight = 6000 * DIM * 4
    dense = math.ceil(weight / 2) + 8 * (held + out)
    assert parts_needed(table, "rows", calls, weight, 0, 8, 1, dense) == 2
    # Routed, the same budget is short of 4 bytes a position of every id: three parts.
    assert parts_needed(table, "rows", calls, weight, 0, 8, 1, dense, routed=True) == 3
    assert parts_needed(table, "rows", calls, weight, 0, 8, 1, dense + 8 * held, routed=True) == 2
