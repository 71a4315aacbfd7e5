"""The memory plan: byte sizes with units, the activation peak of a stage worked out by hand on a
small real Keras model, and budgets (one per device) honoured or refused with the layer named."""

from __future__ import annotations

from pathlib import Path

import keras
import pytest

from shards.bundle.format import read_manifest
from shards.errors import PlanError
from shards.partition.cut import partition_to_bundle
from shards.partition.graph import analyse
from shards.partition.memory_plan import GiB, MemoryModel, parse_budgets, parse_bytes
from shards.partition.stages import plan_stages


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * GiB),
        ("40GB", 40 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 GiB", 3 * 2**29),
        ("123", 123),
        (4096, 4096),
        ("2kb", 2000),
    ],
)
def test_byte_sizes_with_units(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "16 parsecs", "-1", "0", "1e9"])
def test_bad_byte_sizes_are_refused(text: str) -> None:
    with pytest.raises(PlanError, match="byte size"):
        parse_bytes(text)


def test_one_budget_per_device() -> None:
    assert parse_budgets("16GiB,16GiB,40GiB") == (16 * GiB, 16 * GiB, 40 * GiB)
    assert parse_budgets(["1KiB", 5]) == (1024, 5)
    assert parse_budgets(7) == (7,)


def skip_model() -> keras.Model:
    x = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, name="h")(x)
    y = keras.layers.Dense(4, name="y")(h)
    out = keras.layers.Concatenate(name="out")([x, y])
    return keras.Model(x, out)


def test_activation_peak_by_hand() -> None:
    memory = MemoryModel(analyse(skip_model()), plan_batch_rows=10, overhead_bytes=0)
    # Whole model: x (32 B a row) is held all along, and read again by the concat. At h: h (64);
    # at y: h and y (64 + 16); at out: y and out (16 + 48). Peak 32 + 80 = 112 B a row.
    assert memory.activation_rows(0, 3) == (112, False)
    need = memory.need(0, 3)
    assert need.activation_bytes == 1120
    assert need.weight_bytes == (8 * 16 + 16 + 16 * 4 + 4) * 4
    # Stage over y..out: it is sent h and x (64 + 32); then y (16) and out (48) at once.
    assert memory.activation_rows(1, 3) == (96 + 64, False)
    # What crosses after h: h only (x goes from the driver to whoever reads it).
    assert memory.crossing_bytes_per_row(0, 1) == 64
    assert memory.crossing_bytes_per_row(0, 3) == 48


def pooled_tokens() -> keras.Model:
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    emb = keras.layers.Embedding(100, 8, name="emb")(tokens)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(emb)
    return keras.Model(tokens, pooled)


def test_an_unknown_dimension_counts_as_the_sequence_length_and_says_so() -> None:
    graph = analyse(pooled_tokens())
    # tokens (L x int32) held; at the pool, emb (L x 8 floats) and the pooled row (8 floats).
    assert MemoryModel(graph, 1, 0).activation_rows(0, 2) == (4 + 32 + 32, True)
    memory = MemoryModel(graph, 2, 0, sequence_length=100)
    assert memory.activation_rows(0, 2) == (400 + 3200 + 32, True)
    need = memory.need(0, 2)
    assert need.activation_bytes == 2 * 3632
    assert "activations at batch 2, length 100 + " in need.explain()
    with pytest.raises(PlanError, match="max_sequence_length must be an integer >= 1, got 0"):
        MemoryModel(graph, 1, 0, sequence_length=0)


def test_a_bundle_plans_unknown_dimensions_at_max_sequence_length(tmp_path: Path) -> None:
    default = partition_to_bundle(pooled_tokens(), tmp_path / "a", device_overhead_bytes=0)
    (stage,) = default.stages
    assert stage.memory is not None and stage.memory.unknown_dims
    assert stage.memory.sequence_length == 512
    assert stage.memory.activation_bytes == 32 * (512 * 4 + 512 * 32 + 32)
    short = partition_to_bundle(
        pooled_tokens(), tmp_path / "b", device_overhead_bytes=0, max_sequence_length=16
    )
    memory = read_manifest(tmp_path / "b").stages[0].memory
    assert memory is not None and memory.sequence_length == 16
    assert memory.activation_bytes == 32 * (16 * 4 + 16 * 32 + 32)
    assert short.stages[0].memory == memory


def ladder() -> keras.Model:
    features = keras.Input((64,), name="features")
    x = features
    for i, width in enumerate((256, 64, 256, 64, 256, 8)):
        x = keras.layers.Dense(width, name=f"d{i}")(x)
    return keras.Model(features, x)


def test_each_stage_fits_its_own_device(tmp_path: Path) -> None:
    # Weights: 66,560 / 65,792 / 66,560 / 65,792 / 66,560 / 8,224 bytes.
    budgets = [160_000, 90_000, 220_000]
    manifest = partition_to_bundle(
        ladder(),
        tmp_path / "b",
        max_stage_bytes=budgets,
        plan_batch_rows=16,
        device_overhead_bytes=1000,
    )
    assert len(manifest.stages) == 3
    for spec, budget in zip(manifest.stages, budgets, strict=True):
        assert spec.memory is not None and spec.memory.budget_bytes == budget
        assert spec.memory.overhead_bytes == 1000
        assert spec.planned_peak_bytes <= budget
    # The small device got one layer; the activations were counted (16 rows).
    assert manifest.stages[1].memory is not None
    assert manifest.stages[1].memory.first_layer == manifest.stages[1].memory.last_layer
    assert all(s.memory and s.memory.activation_bytes > 0 for s in manifest.stages)


def test_a_layer_that_fits_no_device_is_named() -> None:
    graph = analyse(ladder())
    with pytest.raises(PlanError, match=r"layer 'd0' alone holds .* of activations at batch 16"):
        plan_stages(
            graph, max_stage_bytes="60000,60000", plan_batch_rows=16, device_overhead_bytes=0
        )


def test_devices_too_small_in_that_order_are_refused_with_numbers() -> None:
    graph = analyse(ladder())
    with pytest.raises(
        PlanError,
        match=r"does not fit max_stage_bytes=100000,100000 in order: devices 0..1 hold at most the layers up to 'd1', and layer 'd2' onwards is left over",
    ):
        plan_stages(
            graph, max_stage_bytes=[100_000, 100_000], plan_batch_rows=1, device_overhead_bytes=0
        )


def test_the_layer_a_small_device_cannot_take_is_named() -> None:
    graph = analyse(ladder())
    with pytest.raises(
        PlanError,
        match=r"devices 0..0 hold at most the layers up to 'd1', and stage 1's device \(budget "
        r"40000, 39.1 KiB\) cannot hold the next layer 'd2', which alone holds 65.0 KiB of "
        r"weights \(66560 bytes\) \+ .* of activations at batch 1",
    ):
        plan_stages(
            graph, max_stage_bytes=[200_000, 40_000], plan_batch_rows=1, device_overhead_bytes=0
        )


def test_activations_and_overhead_count_against_the_budget() -> None:
    graph = analyse(ladder())
    weights_only = plan_stages(
        graph, max_stage_bytes=140_000, device_overhead_bytes=0, plan_batch_rows=1
    )
    with_overhead = plan_stages(
        graph, max_stage_bytes=140_000, device_overhead_bytes=20_000, plan_batch_rows=16
    )
    assert len(with_overhead) > len(weights_only)
    assert all(spec.planned_peak_bytes <= 140_000 for _, spec in with_overhead)


def test_weights_served_in_16_bits_count_half() -> None:
    graph = analyse(ladder())
    full = plan_stages(graph, stages=2, device_overhead_bytes=0, plan_batch_rows=4)
    half = plan_stages(
        graph, stages=2, device_overhead_bytes=0, plan_batch_rows=4, weight_dtype="bfloat16"
    )
    for (_, f), (_, h) in zip(full, half, strict=True):
        assert h.memory is not None and h.memory.weight_dtype == "bfloat16"
        assert h.memory.weight_bytes == f.param_bytes // 2
        assert h.planned_peak_bytes == f.planned_peak_bytes - f.param_bytes // 2
    # A budget the float32 weights need 3 stages for fits bfloat16 weights in 2.
    budget = {"max_stage_bytes": 150_000, "device_overhead_bytes": 0, "plan_batch_rows": 1}
    assert len(plan_stages(graph, **budget)) == 3  # type: ignore[arg-type]
    assert len(plan_stages(graph, weight_dtype="bfloat16", **budget)) == 2  # type: ignore[arg-type]


def test_resolve_partitions_to_one_stage_per_device_and_checks_a_bundle(tmp_path: Path) -> None:
    from shards.errors import ResolveError
    from shards.source.resolve import ResolveOptions, resolve_bundle

    budgets = (700 * 2**20 + 100_000, 700 * 2**20 + 100_000)  # the CPU overhead + room
    path = resolve_bundle(
        "demo-tiny",
        ResolveOptions(stages=None, max_stage_bytes=budgets, cache_dir=tmp_path, plan_batch_rows=4),
    )
    manifest = read_manifest(path)
    assert len(manifest.stages) == 2
    assert all(s.memory and s.memory.budget_bytes == budgets[0] for s in manifest.stages)
    # The bundle served as it is: checked against the budgets it is given.
    assert resolve_bundle(
        str(path), ResolveOptions(stages=None, max_stage_bytes=budgets, cache_dir=tmp_path)
    )
    with pytest.raises(ResolveError, match="lists 3 device budgets; give one per stage"):
        resolve_bundle(
            str(path), ResolveOptions(stages=None, max_stage_bytes=(1, 2, 3), cache_dir=tmp_path)
        )
    with pytest.raises(
        ResolveError, match=r"stage 0 needs \d+ bytes at its peak .* over max_stage_bytes=1000"
    ):
        resolve_bundle(
            str(path), ResolveOptions(stages=None, max_stage_bytes=1000, cache_dir=tmp_path)
        )
