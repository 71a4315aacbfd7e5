"""Models nested in models are cut through: their layers are nodes, at any depth."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest

from shards.bundle.format import Manifest, read_manifest
from shards.partition.cut import partition_to_bundle
from shards.partition.graph import PartitionError, analyse
from shards.pipeline.replica_set import PipelineOptions, ReplicaSet
from tests.chain import run_chain
from tests.shards.model_zoo import Inputs, call_whole

TOLERANCE = 1e-4


def _assert_chain_matches(model: keras.Model, inputs: Inputs, bundle: Path) -> None:
    want = call_whole(model, inputs)
    got = run_chain(bundle, inputs)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert float(np.max(np.abs(got[name] - value))) <= TOLERANCE, name


def wrapped_resnet50() -> tuple[keras.Model, Inputs]:
    keras.utils.set_random_seed(7)
    backbone = keras.applications.ResNet50(
        weights=None, include_top=False, input_shape=(32, 32, 3), pooling="avg"
    )
    image = keras.Input((32, 32, 3), name="image")
    x = keras.layers.Rescaling(1 / 127.5, offset=-1.0, name="scale")(image)
    logits = keras.layers.Dense(5, name="logits")(backbone(x))
    rows = np.random.default_rng(7).uniform(0, 255, (2, 32, 32, 3)).astype("float32")
    return keras.Model(image, logits, name="wrapped"), {"image": rows}


def _dense(units: int, name: str) -> keras.layers.Dense:
    return keras.layers.Dense(units, activation="tanh", name=name)


def deeply_nested() -> tuple[keras.Model, Inputs]:
    """A Sequential inside a functional model inside the served one, and a nested model called
    twice (its layers shared between the calls)."""
    keras.utils.set_random_seed(8)
    seq = keras.Sequential([keras.Input((6,)), _dense(6, "s1"), _dense(6, "s2")], name="seq")
    mid_in = keras.Input((6,), name="mid_in")
    mid = keras.Model(mid_in, _dense(6, "m1")(seq(mid_in)), name="mid")
    tower_in = keras.Input((6,), name="tower_in")
    tower = keras.Model(tower_in, _dense(6, "t1")(tower_in), name="tower")
    a = keras.Input((6,), name="a")
    b = keras.Input((6,), name="b")
    both = keras.layers.Concatenate(name="cat")([tower(mid(a)), tower(b)])
    out = keras.layers.Dense(3, name="out")(both)
    rows = np.random.default_rng(8).normal(size=(3, 6)).astype("float32")
    return keras.Model([a, b], out, name="deep"), {"a": rows, "b": -rows}


@pytest.fixture(scope="module")
def wrapped_cut(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[keras.Model, Inputs, Manifest, Path]:
    """The wrapped ResNet50 cut in four once: the chain and the shard actors both serve it."""
    model, inputs = wrapped_resnet50()
    bundle = tmp_path_factory.mktemp("wrapped") / "b"
    return model, inputs, partition_to_bundle(model, bundle, stages=4), bundle


def test_wrapped_resnet50_cut_in_four_matches_the_whole(
    wrapped_cut: tuple[keras.Model, Inputs, Manifest, Path],
) -> None:
    model, inputs, manifest, bundle = wrapped_cut
    graph = analyse(model)
    assert len(graph.nodes) > 100  # the backbone's layers, not one node
    assert len(manifest.stages) == 4
    assert manifest.signature.input_names == ["image"]
    assert manifest.signature.output_names == ["logits"]
    total = sum(w.size * w.dtype.itemsize for w in map(np.asarray, model.get_weights()))
    assert sum(s.param_bytes for s in manifest.stages) == total
    assert max(s.param_bytes for s in manifest.stages) < total
    _assert_chain_matches(model, inputs, bundle)


def test_models_nested_two_deep_and_called_twice_cut_at_every_node(tmp_path: Path) -> None:
    model, inputs = deeply_nested()
    names = [n.name for n in analyse(model).nodes]
    assert sorted(names) == sorted(["s1", "s2", "m1", "t1", "t1", "cat", "out"])
    manifest = partition_to_bundle(model, tmp_path / "b", stages=len(names))
    assert len(manifest.stages) == len(names)
    _assert_chain_matches(model, inputs, tmp_path / "b")


def test_output_of_a_nested_model_keeps_the_outer_name(tmp_path: Path) -> None:
    keras.utils.set_random_seed(9)
    inner_in = keras.Input((4,), name="inner_in")
    inner = keras.Model(inner_in, _dense(2, "head")(_dense(4, "body")(inner_in)), name="inner")
    x = keras.Input((4,), name="x")
    model = keras.Model(x, [inner(x), _dense(3, "side")(x)], name="outer")
    manifest = partition_to_bundle(model, tmp_path / "b", stages=3)
    assert manifest.signature.output_names == ["inner", "side"]
    rows = np.random.default_rng(9).normal(size=(3, 4)).astype("float32")
    got = run_chain(tmp_path / "b", {"x": rows})
    want = model(rows)
    for name, value in zip(["inner", "side"], want, strict=True):
        np.testing.assert_allclose(got[name], keras.ops.convert_to_numpy(value), atol=TOLERANCE)


def test_nested_layers_with_one_name_are_refused_clearly(tmp_path: Path) -> None:
    def block(name: str) -> keras.Model:
        x = keras.Input((4,))
        return keras.Model(x, _dense(4, "same_name")(x), name=name)

    x = keras.Input((4,), name="x")
    model = keras.Model(x, block("second")(block("first")(x)))
    with pytest.raises(PartitionError, match=r"same_name.*distinct names"):
        partition_to_bundle(model, tmp_path / "b", stages=2)


def test_a_subclassed_model_inside_stays_one_node(tmp_path: Path) -> None:
    class Doubler(keras.Model):
        def call(self, x: object) -> object:
            return keras.ops.multiply(x, 2.0)

    x = keras.Input((4,), name="x")
    model = keras.Model(x, _dense(2, "out")(Doubler(name="doubler")(_dense(4, "pre")(x))))
    assert [n.name for n in analyse(model).nodes] == ["pre", "doubler", "out"]


async def test_wrapped_resnet50_through_shard_actors(
    ray_address: str, wrapped_cut: tuple[keras.Model, Inputs, Manifest, Path]
) -> None:
    model, inputs, _, bundle = wrapped_cut
    assert len(read_manifest(bundle).stages) == 4
    group = await ReplicaSet.create(bundle, PipelineOptions(batch_sizes=(2,), cpus_per_shard=0.5))
    try:
        out = await group.run(inputs)
    finally:
        await group.close()
    want = call_whole(model, inputs)
    np.testing.assert_allclose(out["logits"], want["logits"], atol=TOLERANCE, rtol=0)
