"""Nested dict inputs and outputs are served flat, named by their path (``a.b``)."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np

from shards.partition.cut import partition_to_bundle
from tests.chain import run_chain


def test_nested_dicts_are_served_under_dotted_names(tmp_path: Path) -> None:
    keras.utils.set_random_seed(14)
    text = keras.Input((3,), name="text")
    image = keras.Input((2,), name="image")
    hidden = keras.layers.Dense(4, activation="relu", name="hidden")(
        keras.layers.Concatenate(name="cat")([text, image])
    )
    score = keras.layers.Dense(1, name="score")(hidden)
    klass = keras.layers.Dense(2, name="klass")(hidden)
    model = keras.Model(
        {"query": {"text": text}, "image": image},
        {"heads": {"score": score, "all": [klass]}, "hidden": hidden},
        name="nested_io",
    )
    manifest = partition_to_bundle(model, tmp_path / "b", stages=3)
    assert manifest.signature.input_names == ["image", "query.text"]
    assert sorted(manifest.signature.output_names) == ["heads.all.0", "heads.score", "hidden"]

    rng = np.random.default_rng(14)
    rows = {
        "query.text": rng.normal(size=(3, 3)).astype("float32"),
        "image": rng.normal(size=(3, 2)).astype("float32"),
    }
    got = run_chain(tmp_path / "b", rows)
    want = model({"query": {"text": rows["query.text"]}, "image": rows["image"]})
    pairs = [
        ("heads.score", want["heads"]["score"]),
        ("heads.all.0", want["heads"]["all"][0]),
        ("hidden", want["hidden"]),
    ]
    for name, value in pairs:
        np.testing.assert_allclose(got[name], keras.ops.convert_to_numpy(value), atol=1e-5)


def test_nested_lists_keep_the_layer_names(tmp_path: Path) -> None:
    keras.utils.set_random_seed(15)
    a = keras.Input((3,), name="a")
    b = keras.Input((2,), name="b")
    c = keras.Input((1,), name="c")
    joined = keras.layers.Concatenate(name="cat")([a, b, c])
    first = keras.layers.Dense(2, name="first")(joined)
    second = keras.layers.Dense(1, name="second")(joined)
    model = keras.Model([[a, b], c], [[first], second], name="nested_lists")
    manifest = partition_to_bundle(model, tmp_path / "b", stages=2)
    assert manifest.signature.input_names == ["a", "b", "c"]
    assert manifest.signature.output_names == ["first", "second"]
    rows = {k: np.ones((2, n), "float32") for k, n in (("a", 3), ("b", 2), ("c", 1))}
    got = run_chain(tmp_path / "b", rows)
    want = model([[rows["a"], rows["b"]], rows["c"]])
    np.testing.assert_allclose(got["first"], keras.ops.convert_to_numpy(want[0][0]), atol=1e-5)
    np.testing.assert_allclose(got["second"], keras.ops.convert_to_numpy(want[1]), atol=1e-5)
