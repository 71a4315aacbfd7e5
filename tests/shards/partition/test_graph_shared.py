"""A layer called in two places: a cut between the calls, its weights counted in every stage
that calls it, once in a stage that calls it twice."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np

from shards.partition.cut import partition_to_bundle
from shards.partition.graph import analyse
from tests.chain import run_chain
from tests.shards.model_zoo import Inputs, call_whole

TOLERANCE = 1e-4
# Dense(16) on 16 features: 16 x 16 + 16 floats; Dense(2): 16 x 2 + 2 floats.
DENSE16 = (16 * 16 + 16) * 4
DENSE2 = (16 * 2 + 2) * 4


def tied() -> tuple[keras.Model, Inputs]:
    keras.utils.set_random_seed(13)
    features = keras.Input((16,), name="features")
    shared = keras.layers.Dense(16, activation="tanh", name="shared")
    x = keras.layers.Dense(16, activation="relu", name="middle")(shared(features))
    out = keras.layers.Dense(2, name="out")(shared(x))
    rows = np.random.default_rng(13).normal(size=(3, 16)).astype("float32")
    return keras.Model(features, out, name="tied"), {"features": rows}


def _assert_chain_matches(model: keras.Model, inputs: Inputs, bundle: Path) -> None:
    got = run_chain(bundle, inputs)["out"]
    want = call_whole(model, inputs)["out"]
    assert float(np.max(np.abs(got - want))) <= TOLERANCE


def test_each_call_is_charged_the_weights() -> None:
    model, _ = tied()
    costs = [(n.name, n.cost.param_bytes) for n in analyse(model).nodes]
    assert costs == [("shared", DENSE16), ("middle", DENSE16), ("shared", DENSE16), ("out", DENSE2)]


def test_cut_between_the_calls_counts_the_layer_in_both_stages(tmp_path: Path) -> None:
    model, inputs = tied()
    manifest = partition_to_bundle(model, tmp_path / "b", stages=4)
    assert [s.param_bytes for s in manifest.stages] == [DENSE16, DENSE16, DENSE16, DENSE2]
    _assert_chain_matches(model, inputs, tmp_path / "b")


def test_both_calls_in_one_stage_hold_the_weights_once(tmp_path: Path) -> None:
    model, inputs = tied()
    manifest = partition_to_bundle(model, tmp_path / "b", stages=1)
    assert manifest.stages[0].param_bytes == 2 * DENSE16 + DENSE2
    _assert_chain_matches(model, inputs, tmp_path / "b")


def test_a_budget_holds_for_the_stage_of_the_second_call(tmp_path: Path) -> None:
    model, inputs = tied()
    # Room for two Dense(16) and the activations of one row, not for all three layers.
    budget = 2 * DENSE16 + 400
    manifest = partition_to_bundle(
        model, tmp_path / "b", max_stage_bytes=budget, plan_batch_rows=1, device_overhead_bytes=0
    )
    assert len(manifest.stages) == 2
    assert [s.param_bytes for s in manifest.stages] == [2 * DENSE16, DENSE16 + DENSE2]
    assert all(s.planned_peak_bytes <= budget for s in manifest.stages)
    _assert_chain_matches(model, inputs, tmp_path / "b")
