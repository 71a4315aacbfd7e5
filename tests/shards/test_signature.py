"""A tensor's pad value goes into a manifest only when set, and comes back as written."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shards.signature import ModelSignature, TensorSpec


def round_trip(spec: TensorSpec) -> TensorSpec:
    return TensorSpec.from_json(json.loads(json.dumps(spec.to_json())))


def test_a_spec_without_a_pad_value_writes_none() -> None:
    spec = TensorSpec("features", (8,), "float32")
    assert spec.to_json() == {"name": "features", "shape": [8], "dtype": "float32"}
    assert round_trip(spec) == spec


@pytest.mark.parametrize(("dtype", "value"), [("int32", 0), ("bool", False), ("float32", -1.5)])
def test_a_pad_value_survives_json_with_its_type(dtype: str, value: Any) -> None:
    spec = TensorSpec("tokens", (None,), dtype, pad_value=value)
    back = round_trip(spec)
    assert back == spec
    assert type(back.pad_value) is type(value)


def test_a_manifest_signature_written_before_pad_values_loads() -> None:
    old = {
        "name": "m",
        "inputs": [{"name": "tokens", "shape": [None], "dtype": "int32"}],
        "outputs": [{"name": "logits", "shape": [4], "dtype": "float32"}],
    }
    signature = ModelSignature.from_json(old)
    assert signature.inputs[0].pad_value is None
    assert signature.to_json() == old


def test_a_pad_value_that_is_not_a_number_names_the_tensor() -> None:
    bad = {"name": "tokens", "shape": [None], "dtype": "int32", "pad_value": "zero"}
    with pytest.raises(ValueError, match=r"'tokens' has pad_value 'zero'"):
        TensorSpec.from_json(bad)


def test_a_max_length_survives_json_and_an_older_manifest_has_none() -> None:
    spec = TensorSpec("token_ids", (None,), "int32", pad_value=0, max_length=32)
    assert spec.to_json()["max_length"] == 32
    assert round_trip(spec) == spec
    older = {"name": "token_ids", "shape": [None], "dtype": "int32"}  # written before bounds
    assert TensorSpec.from_json(older).max_length is None
    mask = TensorSpec("padding_mask", (None,), "int32")
    signature = ModelSignature("bert", (spec, mask), ())
    assert signature.max_length == 32
    assert ModelSignature("old", (mask,), ()).max_length is None
    with pytest.raises(ValueError, match="has max_length 0; expected an integer >= 1"):
        TensorSpec.from_json({**older, "max_length": 0})
