"""The front end's join of a split output, planned and refused like a stage's memory: what a
batch's join allocates, a version whose join would be over ``driver_join_max_bytes`` refused at
load naming the batch size that fits, the soft cap computed in place, and the join run off the
event loop. No Ray: a manifest on disk and a replica with no actors."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from serving.settings.config import Settings
from serving.version.runner import check_driver_join
from shards.bundle.format import FORMAT_VERSION, Manifest, write_manifest
from shards.errors import PlanError
from shards.pipeline import replica as replica_module
from shards.pipeline.replica import Replica
from shards.signature import ModelSignature, TensorSpec
from shards.split import DriverCombine, check_join_budget, join_bytes

VOCAB = 50_257
GPT2 = ModelSignature(
    name="gpt2",
    inputs=(TensorSpec("token_ids", (None,), "int32", max_length=1024),),
    outputs=(TensorSpec("logits", (None, VOCAB), "float32"),),
)
LOGITS = (DriverCombine("logits", "concat", ("logits.part0", "logits.part1")),)


def test_a_batch_of_gpt2_logits_joined_in_the_front_end_is_counted() -> None:
    assert join_bytes(LOGITS, GPT2, rows=32, sequence_length=1024) == 32 * 1024 * VOCAB * 4


def test_a_join_over_the_budget_names_the_batch_size_that_fits() -> None:
    with pytest.raises(PlanError) as caught:
        check_join_budget(LOGITS, GPT2, 32, 1024, budget=2 * 1024**3)
    assert str(caught.value) == (
        "the front end joins the split output 'logits' of each batch: at max_batch_size 32 and "
        "length 1024 that is 6.1 GiB (196.3 MiB a row), over driver_join_max_bytes=2.0 GiB; "
        "lower max_batch_size to 10 or max_sequence_length, or raise driver_join_max_bytes "
        "where the front end's machine has the memory"
    )
    check_join_budget(LOGITS, GPT2, 10, 1024, budget=2 * 1024**3)  # fits: nothing raised


def test_the_load_refuses_a_max_batch_size_whose_join_does_not_fit(tmp_path: Path) -> None:
    manifest = Manifest(FORMAT_VERSION, GPT2, (), "gpt2.keras", "0" * 64, combines=LOGITS)
    write_manifest(tmp_path, manifest)
    with pytest.raises(PlanError, match=r"at max_batch_size 32 and length 1024 that is 6\.1 GiB"):
        check_driver_join(Settings(max_batch_size=32), tmp_path)
    with pytest.raises(PlanError, match=r"at max_batch_size 4 and length 1024 that is 785"):
        check_driver_join(Settings(max_batch_size=4, driver_join_max_bytes="512MiB"), tmp_path)
    check_driver_join(Settings(max_batch_size=4, max_sequence_length=128), tmp_path)


def test_the_soft_cap_is_the_formula_computed_in_place() -> None:
    capped = DriverCombine("logits", "concat", ("a", "b"), soft_cap=30.0)
    parts = {"a": np.linspace(-90, 90, 12, dtype=np.float32).reshape(3, 4), "b": np.ones((3, 2))}
    got = capped.apply({k: v.astype(np.float32) for k, v in parts.items()})
    joined = np.concatenate([parts["a"], parts["b"].astype(np.float32)], axis=-1)
    np.testing.assert_allclose(got, np.tanh(joined / 30.0) * 30.0, rtol=1e-6)


async def test_a_replica_joins_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    where: list[threading.Thread] = []
    real = replica_module.combine_outputs

    def recorded(combines, made):  # type: ignore[no-untyped-def]
        where.append(threading.current_thread())
        return real(combines, made)

    monkeypatch.setattr(replica_module, "combine_outputs", recorded)
    replica = Replica([], (), {}, None, LOGITS)  # type: ignore[arg-type]
    made = {"logits.part0": np.zeros((2, 3), np.float32), "logits.part1": np.ones((2, 1))}
    await replica._joined({}, made)
    assert where and where[0] is not threading.current_thread()
    assert asyncio.get_running_loop().is_running()


def test_the_plan_counts_the_front_ends_join() -> None:
    from serving.cli.plan_table import plan_table
    from shards.bundle.format import StageMemory, StageSpec

    memory = StageMemory.from_json({"max_batch_size": 32, "sequence_length": 1024})
    stage = StageSpec(0, "stage_0.keras", GPT2.inputs, GPT2.outputs, 0, 0, memory=memory)
    caption = str(plan_table([stage], GPT2, combines=LOGITS).caption)
    assert (
        "the front end joins logits from the parts: 196.3 MiB a row, 6.1 GiB at batch 32 "
        "(within driver_join_max_bytes, or the server refuses the batch size at load)"
    ) in caption
