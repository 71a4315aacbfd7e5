"""The partitioner holds the model plus one part's weights at a time (issue 42, item 4): a split
layer's parts are views of its weights (``shards.split.views``), each read out of the layer as
its stage is written and dropped after. Counted through a hook on the read, not by the
process's memory (``python -m bench.partition_peak`` measures that)."""

from __future__ import annotations

import itertools
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from shards.bundle.format import load_stage
from shards.partition.cut import partition_to_bundle
from shards.partition.demo_models import demo_recommender
from shards.split.views import SliceOf, holds_value
from tests.shards.partition.test_layer_split import mlp, partition_mlp


@dataclass
class Reads:
    """Each part weight read out of its layer (run, not traced): the stage file being written
    then, and how many such reads were alive at once at most."""

    live: set[int] = field(default_factory=set)
    most: int = 0
    during: list[str | None] = field(default_factory=list)
    writing: str | None = None
    # Stage file -> its weights that are views (hold no value) as it is written.
    views: dict[str, int] = field(default_factory=dict)


def watch(monkeypatch: pytest.MonkeyPatch) -> Reads:
    reads, keys = Reads(), itertools.count()
    read, save = SliceOf.__call__, keras.Model.save

    def counted(self: SliceOf, shape: Any = None, dtype: Any = None) -> Any:
        value = read(self, shape, dtype)
        if tf.executing_eagerly():
            key = next(keys)
            reads.live.add(key)
            reads.most = max(reads.most, len(reads.live))
            weakref.finalize(value, reads.live.discard, key)
            reads.during.append(reads.writing)
        return value

    def saving(stage: keras.Model, path: Any, *args: Any, **kwargs: Any) -> None:
        name = Path(path).name
        reads.views[name] = sum(not holds_value(w) for w in stage.weights)
        reads.writing = name
        try:
            save(stage, path, *args, **kwargs)
        finally:
            reads.writing = None

    monkeypatch.setattr(SliceOf, "__call__", counted)
    monkeypatch.setattr(keras.Model, "save", saving)
    return reads


def test_each_part_is_read_out_only_as_its_stage_is_written_one_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The item table by rows in 8 parts and the scores Dense by columns in 2.
    model = demo_recommender()
    reads = watch(monkeypatch)
    manifest = partition_to_bundle(
        model, tmp_path / "b", max_stage_bytes=100_000, plan_batch_rows=1, device_overhead_bytes=0
    )
    parts = [s for s in manifest.stages if s.part is not None]
    assert len(parts) == 10
    # Planning and cutting read no part: each is read while its own stage is written, each of
    # its weights once (a table's rows; a Dense's kernel and bias columns), one at a time.
    assert None not in reads.during
    assert Counter(reads.during) == {s.file: reads.views[s.file] for s in parts}
    assert {s.file: reads.views[s.file] for s in parts} == {
        s.file: 1 if s.part.layer == "items" else 2 for s in parts
    }
    assert reads.most == 1
    # Stages that are not parts hold their weights as before.
    assert all(reads.views[s.file] == 0 for s in manifest.stages if s.part is None)
    # What is written is the layer's slice, exactly.
    table = keras.ops.convert_to_numpy(model.get_layer("items").embeddings)
    for spec in (s for s in parts if s.part.layer == "items"):
        (rows,) = load_stage(tmp_path / "b", spec.index).get_weights()
        np.testing.assert_array_equal(rows, table[spec.part.start : spec.part.stop])


def test_a_pairs_parts_are_read_one_weight_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = watch(monkeypatch)
    manifest = partition_mlp(mlp(), tmp_path / "b")
    parts = [s for s in manifest.stages if s.part is not None]
    # Part 0 holds fc1's kernel and bias columns, fc2's kernel rows and fc2's bias; the others
    # no fc2 bias.
    assert [reads.views[s.file] for s in parts] == [4, 3, 3]
    assert Counter(reads.during) == {s.file: reads.views[s.file] for s in parts}
    assert reads.most == 1
