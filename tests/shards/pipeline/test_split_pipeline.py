"""A layer split across devices (issue 29) served by real stage actors: each part its own actor,
reading the same request tensors, the next stage combining them; a part actor killed with
SIGKILL is brought back like any stage actor; an id outside the vocabulary is the batch's
input error. A tied GPT-2 served with its table split and held once (one actor per part for its
lookups and its logits), its logits joined by the driver."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from shards.bundle.format import read_manifest
from shards.errors import ModelError
from shards.partition.cut import partition_to_bundle
from shards.partition.demo_models import demo_recommender
from shards.pipeline.options import PipelineOptions
from shards.pipeline.placement import per_stage_resources
from shards.pipeline.replica_set import ReplicaSet
from tests.shards.partition.test_layer_split import (
    BUDGET,
    gpt2_inputs,
    mlp,
    mlp_inputs,
    partition_gpt2,
    partition_mlp,
    recommender_inputs,
    tiny_gpt2,
    whole,
)


async def _killed_and_back(group: ReplicaSet, pid: int, inputs: dict[str, np.ndarray]) -> Any:
    """SIGKILL the actor process ``pid``; the next answer once the replica is back (the lost
    batch, if any, retried; the actor restarted and probed back in)."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while True:
        try:
            return await group.run(inputs)
        except Exception:
            assert time.monotonic() < deadline, "the split replica never came back"
            await asyncio.sleep(0.5)


@pytest.mark.asyncio
async def test_a_split_table_serves_and_a_killed_part_actor_recovers(
    ray_address: str, tmp_path: Path
) -> None:
    model, inputs = demo_recommender(), recommender_inputs()
    manifest = partition_to_bundle(
        model, tmp_path / "b", max_stage_bytes=BUDGET, plan_batch_rows=8, device_overhead_bytes=0
    )
    # Routed, the default: per id tensor the part's vectors and their positions.
    assert [tuple(t.shape) for t in manifest.stages[0].outputs] == [(32,), (), (32,), ()]
    want = whole(model, inputs)
    group = await ReplicaSet.create(tmp_path / "b", PipelineOptions(replicas=1, batch_sizes=(5,)))
    try:
        outs = await asyncio.gather(*(group.run(inputs) for _ in range(4)))
        for out in outs:
            np.testing.assert_array_equal(out["scores"], want)
        stats = {s["stage"]: s["calls"] for s in await group.stats()}
        # Both parts ran every batch (the warm-up's included), side by side with one another.
        assert stats["0.0"] == stats["0.1"] == stats["1"] >= 4
        # An id outside the vocabulary is the batch's error, as the whole model's lookup raises
        # it on a CPU (not zeros from every part): input-blamed, so the server isolates its row.
        bad = {k: v.copy() for k, v in inputs.items()}
        bad["history"][2, 3] = 7000
        with pytest.raises(ModelError, match=r"indices\[2,3\] = 7000 is not in \[0, 6000\)") as err:
            await group.run(bad)
        assert err.value.input_blamed
        (part,) = [i for i in await group.describe() if i["stage"] == "0.1"]
        out = await _killed_and_back(group, part["pid"], inputs)
        np.testing.assert_array_equal(out["scores"], want)
        (after,) = [i for i in await group.describe() if i["stage"] == "0.1"]
        assert after["pid"] != part["pid"]
    finally:
        await group.close()


@pytest.mark.asyncio
async def test_a_dense_split_table_serves_equal_to_the_whole_model(
    ray_address: str, tmp_path: Path
) -> None:
    # The test above serves the routed combine, the default since issue 42 (each part actor
    # sends only its rows' vectors and their positions); this one the dense combine, asked for
    # (each part the whole lookup, zeros outside its rows, the next stage adds): a batch padded
    # to 8 rows answers exactly too.
    model, inputs = demo_recommender(), recommender_inputs()
    manifest = partition_to_bundle(
        model,
        tmp_path / "b",
        max_stage_bytes=BUDGET,
        plan_batch_rows=8,
        device_overhead_bytes=0,
        lookup_combine="dense",
    )
    assert [tuple(t.shape) for t in manifest.stages[0].outputs] == [(20, 32), (1, 32)]
    want = whole(model, inputs)
    group = await ReplicaSet.create(tmp_path / "b", PipelineOptions(replicas=1, batch_sizes=(8,)))
    try:
        outs = await asyncio.gather(*(group.run(inputs) for _ in range(3)))
        for out in outs:
            np.testing.assert_array_equal(out["scores"], want)
        bad = {k: v.copy() for k, v in inputs.items()}
        bad["history"][2, 3] = 7000
        with pytest.raises(ModelError, match=r"indices\[2,3\] = 7000 is not in") as err:
            await group.run(bad)
        assert err.value.input_blamed
    finally:
        await group.close()


@pytest.mark.asyncio
async def test_a_paired_mlp_serves_in_two_places_and_a_killed_part_actor_recovers(
    ray_address: str, tmp_path: Path
) -> None:
    # fc1 -> fc2, each too large for a device, paired (issue 42): three part actors side by
    # side, each holding a third of both layers and sending only its partial sum, then the head.
    model, inputs = mlp(), mlp_inputs()
    manifest = partition_mlp(model, tmp_path / "b")
    assert [s.name for s in manifest.stages] == ["0.0", "0.1", "0.2", "1"]
    want = whole(model, inputs)
    options = PipelineOptions(replicas=1, batch_sizes=(5,), cpus_per_shard=0.5)
    group = await ReplicaSet.create(tmp_path / "b", options)
    try:
        assert (group.num_stages, group.pipeline_depth) == (4, 2)
        outs = await asyncio.gather(*(group.run(inputs) for _ in range(3)))
        for out in outs:
            # The partial products' sum reorders fc2's additions: 1e-5 relative.
            np.testing.assert_allclose(out["head"], want, rtol=1e-5, atol=1e-7)
        (part,) = [i for i in await group.describe() if i["stage"] == "0.2"]
        out = await _killed_and_back(group, part["pid"], inputs)
        np.testing.assert_allclose(out["head"], want, rtol=1e-5, atol=1e-7)
        (after,) = [i for i in await group.describe() if i["stage"] == "0.2"]
        assert after["pid"] != part["pid"]
    finally:
        await group.close()


@pytest.mark.asyncio
async def test_a_tied_gpt2_is_served_by_one_set_of_table_parts_that_recovers(
    ray_address: str, tmp_path: Path
) -> None:
    # keras_hub's GPT2CausalLM: its 5000 x 16 table split once and held once (issue 42): part
    # k's actor looks up its rows at the start of the pipeline and computes their logits at the
    # end, from one copy of them, its logits in a concurrency group of their own. The logits
    # (the model's output) come back to the driver as parts and are concatenated there.
    model, inputs = tiny_gpt2(), gpt2_inputs()
    manifest = partition_gpt2(model, tmp_path / "b", imports=["keras_hub"])
    assert [s.name for s in manifest.stages] == ["0.0", "0.1", "1", "2.0", "2.1"]
    assert (manifest.hosts, manifest.actors, manifest.depth) == ([0, 1, 2, 0, 1], 3, 3)
    (combine,) = manifest.combines
    assert (combine.how, combine.parts) == (
        "concat",
        ("token_embedding_logits_part0of2", "token_embedding_logits_part1of2"),
    )
    want = keras.ops.convert_to_numpy(model(inputs))
    options = PipelineOptions(
        replicas=1, batch_sizes=(3,), imports=("keras_hub",), cpus_per_shard=0.5
    )
    group = await ReplicaSet.create(tmp_path / "b", options)
    try:
        # Five stages at three places, a pipeline three deep, in three actors: each place of a
        # table part shares its actor with the other place of the same part.
        assert (group.num_stages, group.pipeline_depth) == (5, 3)
        (pipeline,) = group._pipelines
        assert pipeline.actors[0] is pipeline.actors[3] and pipeline.actors[1] is pipeline.actors[4]
        assert len(pipeline.processes) == 3
        outs = await asyncio.gather(*(group.run(inputs) for _ in range(3)))
        for out in outs:
            assert list(out) == [combine.output]
            # A column slice of a matrix product may take another kernel: 1e-6 relative.
            np.testing.assert_allclose(out[combine.output], want, rtol=1e-6, atol=1e-7)
        info = {i["stage"]: i for i in await group.describe()}
        assert info["0.0"]["pid"] == info["2.0"]["pid"] != info["0.1"]["pid"] == info["2.1"]["pid"]
        # The rows once in the process: the host's weights are its 2500 x 16 float32 rows, and
        # its guest (the logits part) holds none of its own.
        assert info["0.0"]["memory"]["weight_bytes"] == 2500 * 16 * 4
        assert (info["2.0"]["held_by"], info["2.0"]["weight_bytes"]) == (0, 0)
        assert info["0.0"]["guests"] == [3]
        calls = {s["stage"]: s["calls"] for s in await group.stats()}
        assert calls["0.0"] == calls["2.0"] == calls["1"] >= 3
        # The shared part actor killed: restarted, both its places answer again.
        out = await _killed_and_back(group, info["0.1"]["pid"], inputs)
        np.testing.assert_allclose(out[combine.output], want, rtol=1e-6, atol=1e-7)
        after = {i["stage"]: i for i in await group.describe()}
        assert after["0.1"]["pid"] == after["2.1"]["pid"] != info["0.1"]["pid"]
        # The same actors as a compiled graph (a host's two stages called in turn), whose two
        # leaves (the parts) come back as two futures: joined by the driver the same way.
        for pipeline in group._pipelines:
            pipeline.compile(3)
        out = await group.run(inputs)
        np.testing.assert_allclose(out[combine.output], want, rtol=1e-6, atol=1e-7)
    finally:
        await group.close()


def test_stage_resources_are_given_per_stage_or_per_place_in_the_pipeline(tmp_path: Path) -> None:
    partition_to_bundle(
        demo_recommender(),
        tmp_path / "b",
        max_stage_bytes=BUDGET,
        plan_batch_rows=8,
        device_overhead_bytes=0,
    )
    manifest = read_manifest(tmp_path / "b")
    a, b, c = {"node_a": 1.0}, {"node_b": 1.0}, {"node_c": 1.0}
    # Stages "0.0", "0.1" and "1": each part its own entry (to spread a table over nodes) ...
    assert per_stage_resources(manifest, (a, b, c)) == (a, b, c)
    # ... or one per place, the parts of a split layer asking the same.
    assert per_stage_resources(manifest, (a, c)) == (a, a, c)
    with pytest.raises(ValueError, match=r"has 4 entries; the bundle has 3 stages \(0.0, 0.1, 1\)"):
        per_stage_resources(manifest, (a, b, c, c))
