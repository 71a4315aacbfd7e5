"""TF-Serving-style JSON bodies to numpy arrays and back, checked against the model signature.

Row form:      {"instances": [row, ...]}      -> {"predictions": [row, ...]}
Columnar form: {"inputs": array | {name: array}} -> {"outputs": array | {name: array}}

A row of a multi-input model is an object keyed by input name. Decoding never uses pydantic
over the numeric payload (slow): orjson parses, numpy converts, and each check names what was
wrong and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import orjson

from serving.errors import InvalidInputError
from shards.signature import ModelSignature, TensorSpec

Form = Literal["instances", "inputs"]
_ALLOWED_KEYS = {"instances", "inputs", "signature_name"}
_OUTPUT_KEY = {"instances": "predictions", "inputs": "outputs"}


@dataclass(frozen=True)
class Decoded:
    inputs: dict[str, np.ndarray]
    rows: int
    form: Form


def decode_predict(body: bytes, signature: ModelSignature) -> Decoded:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInputError(f"body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidInputError(
            f'body must be a JSON object with "instances" or "inputs", got {type(payload).__name__}'
        )
    unknown = sorted(set(payload) - _ALLOWED_KEYS)
    if unknown:
        raise InvalidInputError(
            f'unknown key(s) {unknown} in body; expected "instances" (rows) or "inputs" (columns)'
        )
    if ("instances" in payload) == ("inputs" in payload):
        raise InvalidInputError(
            'body must have exactly one of "instances" (rows) or "inputs" (columns)'
        )
    if "instances" in payload:
        columns = _columns_from_instances(payload["instances"], signature)
        form: Form = "instances"
    else:
        columns = _columns_from_inputs(payload["inputs"], signature)
        form = "inputs"
    # numpy reads [0.5, true] as [0.5, 1.0]; a body without true/false needs no scan for them.
    maybe_bool = b"true" in body or b"false" in body
    arrays = {
        spec.name: _to_array(columns[spec.name], spec, maybe_bool) for spec in signature.inputs
    }
    rows = {name: arr.shape[0] for name, arr in arrays.items()}
    if len(set(rows.values())) != 1:
        raise InvalidInputError(f"inputs have different row counts {rows}; all must be equal")
    return Decoded(inputs=arrays, rows=next(iter(rows.values())), form=form)


def encode_predict(outputs: dict[str, np.ndarray], signature: ModelSignature, form: Form) -> bytes:
    key = _OUTPUT_KEY[form]
    names = signature.output_names
    value: Any
    if len(names) == 1:
        value = outputs[names[0]]
    elif form == "inputs":
        value = {name: outputs[name] for name in names}
    else:
        n = outputs[names[0]].shape[0]
        value = [{name: outputs[name][i] for name in names} for i in range(n)]
    return orjson.dumps({key: value}, option=orjson.OPT_SERIALIZE_NUMPY)


def _columns_from_instances(instances: Any, signature: ModelSignature) -> dict[str, Any]:
    if not isinstance(instances, list):
        raise InvalidInputError(
            f'"instances" must be a list of rows, got {type(instances).__name__}'
        )
    if not instances:
        raise InvalidInputError('"instances" is empty; send at least one row')
    names = signature.input_names
    keyed = isinstance(instances[0], dict)
    if len(names) == 1 and not keyed:
        if any(isinstance(row, dict) for row in instances):
            raise InvalidInputError("instances mix objects and plain rows; use one form")
        return {names[0]: instances}
    if not keyed:
        raise InvalidInputError(
            f"the model has {len(names)} inputs {names}: each instance must be an object keyed "
            f"by input name, got {type(instances[0]).__name__} in instance 0"
        )
    columns: dict[str, list[Any]] = {name: [] for name in names}
    for i, row in enumerate(instances):
        if not isinstance(row, dict):
            raise InvalidInputError(f"instance {i} is {type(row).__name__}; expected an object")
        _check_keys(row, names, f"instance {i}")
        for name in names:
            columns[name].append(row[name])
    return columns


def _columns_from_inputs(inputs: Any, signature: ModelSignature) -> dict[str, Any]:
    names = signature.input_names
    if isinstance(inputs, dict):
        _check_keys(inputs, names, '"inputs"')
        return inputs
    if len(names) == 1:
        return {names[0]: inputs}
    raise InvalidInputError(
        f'the model has {len(names)} inputs {names}: "inputs" must be an object keyed by input name'
    )


def _check_keys(obj: dict[str, Any], names: list[str], where: str) -> None:
    missing = [n for n in names if n not in obj]
    extra = sorted(set(obj) - set(names))
    if extra:
        raise InvalidInputError(f"{where} has unknown input(s) {extra}; expected {names}")
    if missing:
        raise InvalidInputError(f"{where} is missing input(s) {missing}; expected {names}")


def _to_array(value: Any, spec: TensorSpec, maybe_bool: bool = True) -> np.ndarray:
    where = f"input {spec.name!r}"
    if not isinstance(value, list):
        raise InvalidInputError(
            f"{where} must be a list of rows shaped {spec.describe()}, got {type(value).__name__}"
        )
    if not value:
        raise InvalidInputError(f"{where} has no rows; send at least one")
    try:
        arr = np.asarray(value)
    except ValueError:
        raise InvalidInputError(
            f"{where} is ragged (rows of different lengths); expected {spec.describe()}"
        ) from None
    kind = arr.dtype.kind
    want = spec.np_dtype.kind
    if kind == "O":
        raise InvalidInputError(
            f"{where} is ragged or holds null/non-numbers; expected {spec.describe()}"
        )
    if kind in "US":
        raise InvalidInputError(f"{where} holds strings; expected numbers {spec.describe()}")
    if want != "b" and (kind == "b" or (maybe_bool and _holds_bool(value))):
        raise InvalidInputError(f"{where} holds booleans; expected numbers {spec.describe()}")
    if want in "iu" and kind == "f":
        raise InvalidInputError(f"{where} holds non-integers; expected {spec.describe()}")
    if not spec.matches_row_shape(arr.shape[1:]):
        got = ", ".join(str(d) for d in arr.shape)
        raise InvalidInputError(f"{where} has shape ({got}); expected {spec.describe()}")
    if want in "iu" and arr.size:
        info = np.iinfo(spec.np_dtype)
        if arr.min() < info.min or arr.max() > info.max:
            raise InvalidInputError(f"{where} holds values outside the range of {spec.dtype}")
    return np.ascontiguousarray(arr, dtype=spec.np_dtype)


def _holds_bool(value: Any) -> bool:
    if isinstance(value, list):
        return any(_holds_bool(v) for v in value)
    return isinstance(value, bool)
