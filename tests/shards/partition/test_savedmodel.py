"""read_savedmodel: any exporter's ``serving_default`` signature, and one-line refusals of what
the server cannot batch or decode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shards.errors import PartitionError
from shards.partition.savedmodel import read_savedmodel


def _save(path: Path, spec: Any, key: str = "serving_default") -> None:
    import tensorflow as tf

    module = tf.Module()
    module.serve = tf.function(lambda x: {"x": x}, input_signature=[spec])
    tf.saved_model.save(module, str(path), signatures={key: module.serve})


def test_signature_and_variable_bytes_of_a_tf_module(tmp_path: Path) -> None:
    import tensorflow as tf

    module = tf.Module()
    module.w = tf.Variable(tf.ones((3, 4)))
    module.unused = tf.Variable(tf.ones((1000,)))  # saved, but not read by the signature
    module.serve = tf.function(
        lambda a, b: {"sum": tf.matmul(a, module.w) + tf.cast(b, tf.float32)[:, None]},
        input_signature=[tf.TensorSpec((None, 3), name="a"), tf.TensorSpec((None,), tf.int64)],
    )
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.serve})
    info = read_savedmodel(tmp_path / "m")
    assert [(t.name, t.shape, t.dtype) for t in info.inputs] == [
        ("a", (3,), "float32"),
        ("b", (), "int64"),
    ]
    assert [(t.name, t.shape, t.dtype) for t in info.outputs] == [("sum", (4,), "float32")]
    assert info.weight_bytes == 3 * 4 * 4


@pytest.mark.parametrize(
    ("shape", "dtype", "reason"),
    [
        ((None,), "string", r"input 'x' of 'serving_default' is string; shardserve serves"),
        ((1, 3), "float32", r"input 'x' .* fixed first dimension 1; .*None"),
        (None, "float32", r"input 'x' .* of unknown rank; .*\(None, \.\.\.\)"),
    ],
)
def test_unservable_inputs_are_refused_by_name(
    tmp_path: Path, shape: Any, dtype: str, reason: str
) -> None:
    import tensorflow as tf

    _save(tmp_path / "m", tf.TensorSpec(shape, dtype, name="x"))
    with pytest.raises(PartitionError, match="cannot read SavedModel m: " + reason):
        read_savedmodel(tmp_path / "m")


def test_no_serving_default_lists_the_signatures(tmp_path: Path) -> None:
    import tensorflow as tf

    _save(tmp_path / "m", tf.TensorSpec((None, 3), name="x"), key="classify")
    with pytest.raises(PartitionError, match=r"no 'serving_default' signature .*\['classify'\]"):
        read_savedmodel(tmp_path / "m")
