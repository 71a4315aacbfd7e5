"""A split layer's parts side by side in the pipeline (``shards.split.places``): the labels, the
places and the depth every consumer reads from the manifest, with no TensorFlow."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shards.split import StagePart, hosts, pipeline_depth, place_labels, places


def part(
    layer: str, k: int, parts: int, use: str | None = None, held_by: int | None = None
) -> StagePart:
    return StagePart(layer, "Embedding", "rows", k, parts, k * 10, (k + 1) * 10, use, held_by)


def test_the_parts_of_one_layer_share_a_place_and_count_once() -> None:
    # A table's lookup parts, a stage, the same table's logits parts (another use), a stage.
    stages = [
        part("t", 0, 2),
        part("t", 1, 2),
        None,
        part("t", 0, 2, "logits"),
        part("t", 1, 2, "logits"),
        None,
    ]
    assert place_labels(stages) == ["0.0", "0.1", "1", "2.0", "2.1", "3"]
    assert places(stages) == [0, 0, 1, 2, 2, 3]
    assert pipeline_depth(stages) == 4
    assert pipeline_depth([None, None, None]) == 3


def test_a_tied_table_held_once_runs_its_logits_in_its_lookup_actors() -> None:
    # Part k's logits (stage 3 + k) held by part k's lookup (stage k): three actors, the places
    # and the depth unchanged.
    stages = [
        part("t", 0, 2),
        part("t", 1, 2),
        None,
        part("t", 0, 2, "logits", held_by=0),
        part("t", 1, 2, "logits", held_by=1),
    ]
    assert hosts(stages) == [0, 1, 2, 0, 1]
    assert (places(stages), pipeline_depth(stages)) == ([0, 0, 1, 2, 2], 3)
    assert hosts([None, part("t", 0, 1)]) == [0, 1]
    with pytest.raises(ValueError, match="stage 2 is held by stage 1, which is not a host"):
        hosts([part("t", 0, 1), part("t", 0, 1, "logits", held_by=0), part("u", 0, 1, None, 1)])


def test_the_interface_reads_a_manifest_without_tensorflow_or_keras() -> None:
    code = (
        "import sys, shards.split, shards.bundle.format; "
        "print('keras' in sys.modules, 'tensorflow' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]
