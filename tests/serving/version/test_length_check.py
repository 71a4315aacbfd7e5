"""The warm-up check of length padding, on fake models written in numpy: a masked mean (safe), a
per-token tagger (safe, output cut back), a model that counts its positions (unsafe), one unsafe
only at long paddings; the inputs that qualify and the errors naming the bad ones."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from serving.settings.config import ConfigError, load_settings
from serving.version.length_check import plan_length_padding, probe_row
from shards.signature import ModelSignature, TensorSpec
from tests.fakes import FakeRunner
from tests.metrics_text import metric
from tests.serving.served_app import serve

Fn = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


class FnRunner(FakeRunner):
    """A fake model: ``fn`` of the batch; every batch's inputs kept in ``batches``."""

    def __init__(self, signature: ModelSignature, fn: Fn) -> None:
        super().__init__(signature)
        self.fn = fn

    async def run_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.batches.append(inputs)
        return self.fn(inputs)


def token_signature(output: TensorSpec, *extra: TensorSpec) -> ModelSignature:
    return ModelSignature("toy", (TensorSpec("ids", (None,), "int32"), *extra), (output,))


def masked_mean(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    ids = batch["ids"].astype(np.float32)
    mask = ids != 0
    features = np.stack([ids, np.sqrt(np.abs(ids)), np.sin(ids), np.ones_like(ids)], axis=-1)
    total = (features * mask[..., None]).sum(axis=1)
    return {"y": total / np.maximum(mask.sum(axis=1), 1)[:, None]}


def tagger(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    ids = batch["ids"].astype(np.float32)
    return {"tags": np.stack([ids, -ids, ids * ids], axis=-1)}


def position_count(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # Sees pad positions: what a Conv1D + GlobalMaxPooling1D without a mask does.
    ids = batch["ids"].astype(np.float32)
    return {"y": (ids + 1.0).sum(axis=1, keepdims=True)}


def odd_beyond_100(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = masked_mean(batch)
    if batch["ids"].shape[1] > 100:  # e.g. a position embedding that wraps
        out["y"] = out["y"] + 1.0
    return out


MEAN = token_signature(TensorSpec("y", (4,), "float32"))
TAGS = token_signature(TensorSpec("tags", (None, 3), "float32"))
COUNT = token_signature(TensorSpec("y", (1,), "float32"))


async def test_a_masked_model_is_padded_along_its_length() -> None:
    runner = FnRunner(MEAN, masked_mean)
    plan = await plan_length_padding(runner, load_settings(pad_inputs=["ids=0"]))
    assert plan.padding is not None, plan.reason
    assert dict(plan.padding.axes) == {"ids": 1}
    assert dict(plan.padding.pad_values) == {"ids": 0}
    assert plan.padding.buckets == (16, 32, 64, 128, 256, 512)
    assert dict(plan.padding.output_axes) == {}
    assert plan.parameters() == {
        "inputs": ["ids"],
        "buckets": [16, 32, 64, 128, 256, 512],
        "outputs_cut_back": [],
    }
    lengths = {b["ids"].shape[1] for b in runner.batches}
    # the output axes at 5 and 9; rows of 1, 7, 15 alone and padded to 16; 7 padded to 512
    assert lengths == {5, 9, 1, 7, 15, 16, 512}


async def test_an_input_the_model_masks_is_padded_without_being_named() -> None:
    masked = ModelSignature(
        "toy", (TensorSpec("ids", (None,), "int32", pad_value=0),), MEAN.outputs
    )
    plan = await plan_length_padding(FnRunner(masked, masked_mean), load_settings())
    assert plan.padding is not None, plan.reason
    assert dict(plan.padding.pad_values) == {"ids": 0}
    # --pad-input overrides the model's own value: here with one the model does not mask
    plan = await plan_length_padding(
        FnRunner(masked, masked_mean), load_settings(pad_inputs="ids=-1")
    )
    assert plan.padding is None
    assert "output 'y' of a row of length 1 padded to 16 differs" in plan.reason


async def test_a_per_token_output_is_cut_back(caplog: pytest.LogCaptureFixture) -> None:
    runner = FnRunner(TAGS, tagger)
    with caplog.at_level(logging.INFO, "shardserve"):
        plan = await plan_length_padding(
            runner, load_settings(pad_inputs=["ids=0"], allowed_lengths="8,32")
        )
    assert plan.padding is not None, plan.reason
    assert dict(plan.padding.output_axes) == {"tags": 1}
    assert plan.padding.buckets == (8, 32, 512)
    assert (
        "length padding on for inputs ['ids'] along their length, buckets [8, 32, 512], "
        "outputs cut back: ['tags']" in caplog.text
    )


async def test_a_model_that_sees_pad_positions_is_served_unpadded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runner = FnRunner(COUNT, position_count)
    with caplog.at_level(logging.WARNING, "shardserve"):
        plan = await plan_length_padding(runner, load_settings(pad_inputs=["ids=0"]))
    assert plan.padding is None
    # the first pair checked: a row of 1 padded to 16 counts 15 more positions
    assert plan.reason == (
        "padding changes this model's answers: output 'y' of a row of length 1 padded to 16 "
        "differs from the row alone by 15 (over 1e-05 of its largest value, 7)"
    )
    assert plan.parameters() == {"off": plan.reason}
    assert "length padding off: padding changes this model's answers" in caplog.text


async def test_a_difference_only_at_the_longest_bucket_is_caught() -> None:
    plan = await plan_length_padding(
        FnRunner(MEAN, odd_beyond_100), load_settings(pad_inputs=["ids=0"])
    )
    assert plan.padding is None
    assert "a row of length 7 padded to 512" in plan.reason


async def test_no_pad_lengths_turns_it_off() -> None:
    runner = FnRunner(MEAN, masked_mean)
    plan = await plan_length_padding(
        runner, load_settings(pad_inputs=["ids=0"], pad_lengths="false")
    )
    assert (plan.padding, plan.reason) == (None, "turned off by --no-pad-lengths")
    assert runner.batches == []


async def test_an_unknown_length_without_a_pad_value_keeps_it_off() -> None:
    signature = token_signature(
        TensorSpec("y", (4,), "float32"), TensorSpec("positions", (None,), "int32")
    )
    plan = await plan_length_padding(
        FnRunner(signature, masked_mean), load_settings(pad_inputs=["ids=0"])
    )
    assert plan.padding is None
    assert plan.reason.startswith("inputs ['positions'] have an unknown length but no pad value")


async def test_a_model_of_fixed_shapes_has_nothing_to_pad() -> None:
    plan = await plan_length_padding(FakeRunner(), load_settings())
    assert (plan.padding, plan.parameters()) == (None, None)


@pytest.mark.parametrize("name", ["nope", "features"])
async def test_pad_input_must_name_an_input_of_one_unknown_dimension(name: str) -> None:
    signature = token_signature(
        TensorSpec("y", (4,), "float32"), TensorSpec("features", (3,), "float32")
    )
    with pytest.raises(ConfigError) as info:
        await plan_length_padding(
            FnRunner(signature, masked_mean), load_settings(pad_inputs=[f"{name}=0"])
        )
    assert str(info.value) == (
        f"--pad-input names ['{name}'], which this model does not take with exactly one "
        "unknown dimension; inputs that can be length padded: ['ids']"
    )


def test_probe_rows_are_deterministic_with_the_pad_value_at_pad_positions() -> None:
    signature = ModelSignature(
        "toy",
        (
            TensorSpec("token_ids", (None,), "int32"),
            TensorSpec("segment_ids", (None,), "int32"),
            TensorSpec("padding_mask", (None,), "bool"),
            TensorSpec("dense", (None, 2), "float32"),
        ),
        (),
    )
    pads: dict[str, Any] = {"token_ids": 0, "segment_ids": 0, "padding_mask": False, "dense": 0.0}
    row = probe_row(signature, 7, pads, padded_to=16)
    alone = probe_row(signature, 7, pads)
    for name, array in row.items():
        assert array.shape[:2] == (1, 16)
        np.testing.assert_array_equal(array[:, :7], alone[name])
        assert not np.any(array[:, 7:])
    assert alone["token_ids"].min() >= 1 and alone["token_ids"].max() < 10
    assert set(np.unique(alone["segment_ids"])) <= {0, 1}
    assert alone["padding_mask"].all()
    np.testing.assert_array_equal(probe_row(signature, 7, pads)["dense"], alone["dense"])


async def test_a_served_model_batches_mixed_lengths_and_its_metadata_says_so() -> None:
    signature = ModelSignature(
        "toy", (TensorSpec("ids", (None,), "int32", pad_value=0),), TAGS.outputs
    )
    runner = FnRunner(signature, tagger)
    async with serve(runner, max_sequence_length=64, max_batch_size=2) as client:
        meta = (await client.get("/v2/models/fake")).json()
        assert meta["parameters"] == {
            "length_padding": {
                "inputs": ["ids"],
                "buckets": [16, 32, 64],
                "outputs_cut_back": ["tags"],
            }
        }
        runner.batches.clear()
        rows = [list(range(1, 4)), list(range(1, 21))]
        answers = await asyncio.gather(
            *(client.post("/v1/models/fake:predict", json={"instances": [r]}) for r in rows)
        )
        metrics = (await client.get("/metrics")).text
    assert [b["ids"].shape for b in runner.batches] == [(2, 32)]
    # 3 + 20 real positions; 2 x 32 - 23 added
    assert metric(metrics, "shardserve_padded_positions_total", kind="real") == 23.0
    assert metric(metrics, "shardserve_padded_positions_total", kind="pad") == 41.0
    for ids, answer in zip(rows, answers, strict=True):
        assert answer.status_code == 200, answer.text
        want = tagger({"ids": np.array([ids], np.int32)})["tags"][0]
        np.testing.assert_allclose(answer.json()["predictions"][0], want)


async def test_a_served_model_that_padding_changes_says_why_it_is_off() -> None:
    signature = ModelSignature(
        "toy", (TensorSpec("ids", (None,), "int32", pad_value=0),), COUNT.outputs
    )
    runner = FnRunner(signature, position_count)
    async with serve(runner, max_sequence_length=64) as client:
        meta = (await client.get("/v2/models/fake")).json()
        assert client.shardserve.model().batcher.length_padding is None
    assert meta["parameters"]["length_padding"]["off"].startswith(
        "padding changes this model's answers: output 'y' of a row of length 1 padded to 16"
    )
