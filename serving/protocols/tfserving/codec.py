"""TF-Serving-style JSON bodies to numpy arrays and back, checked against the model signature.

Row form:      {"instances": [row, ...]}      -> {"predictions": [row, ...]}
Columnar form: {"inputs": array | {name: array}} -> {"outputs": array | {name: array}}

A row of a multi-input model is an object keyed by input name. Decoding never uses pydantic
over the numeric payload (slow): orjson parses, numpy converts, and each check names what was
wrong and what was expected.

Rows may differ in length where the model leaves a dimension unknown (token ids): such a
ragged ``instances`` body decodes to one dict of arrays per row (``Decoded.ragged``), each
answered at its own length (``encode_rows``). The columnar form stays rectangular.

A body is held to what the model's queue can take (``serving.protocols.limits``): its values
counted before it is parsed, its rows right after, before any per-row work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import orjson

from serving.errors import InvalidInputError
from serving.protocols.json_strings import holds_string
from serving.protocols.limits import DEFAULT_LIMITS, RequestLimits
from serving.quoting import quote, quote_all
from shards.signature import ModelSignature, TensorSpec

Form = Literal["instances", "inputs"]
_ALLOWED_KEYS = {"instances", "inputs", "signature_name"}
_OUTPUT_KEY = {"instances": "predictions", "inputs": "outputs"}


@dataclass(frozen=True)
class Decoded:
    """Rectangular: ``inputs`` holds each input's rows stacked. Ragged (``instances`` of
    different lengths): ``ragged`` holds one dict per row, arrays without the batch dimension,
    and ``inputs`` is empty."""

    inputs: dict[str, np.ndarray]
    rows: int
    form: Form
    ragged: list[dict[str, np.ndarray]] | None = None


class _RaggedError(InvalidInputError):
    """An input's rows did not stack into one array (rows of different shapes)."""


def decode_predict(
    body: bytes | bytearray, signature: ModelSignature, limits: RequestLimits = DEFAULT_LIMITS
) -> Decoded:
    """The body's arrays; refused before it is parsed where it holds more values than
    ``limits`` let a request hold, and before any per-row work where it has too many rows."""
    limits.check_json(body, signature)
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInputError(f"body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidInputError(
            f'body must be a JSON object with "instances" or "inputs", got {type(payload).__name__}'
        )
    unknown = [key for key in payload if key not in _ALLOWED_KEYS]
    if unknown:
        raise InvalidInputError(
            f"unknown key(s) {quote_all(unknown, sort=True)} in body; expected "
            '"instances" (rows) or "inputs" (columns)'
        )
    if ("instances" in payload) == ("inputs" in payload):
        raise InvalidInputError(
            'body must have exactly one of "instances" (rows) or "inputs" (columns)'
        )
    if "instances" in payload:
        columns = _columns_from_instances(payload["instances"], signature, limits)
        form: Form = "instances"
    else:
        columns = _columns_from_inputs(payload["inputs"], signature)
        for column in columns.values():
            if isinstance(column, list):
                limits.check_rows(len(column))
        form = "inputs"
    if body.count(b'"') > _structure_quotes(payload, signature):
        _refuse_strings(columns, signature)
    # numpy reads [0.5, true] as [0.5, 1.0]; a body without true/false needs no scan for them.
    maybe_bool = b"true" in body or b"false" in body
    try:
        arrays = {
            spec.name: _to_array(columns[spec.name], spec, maybe_bool) for spec in signature.inputs
        }
    except _RaggedError as exc:
        # Rectangular bodies never get here: the ragged path costs only the bodies it serves.
        if form == "inputs":
            raise _columnar_ragged(exc, signature) from None
        ragged = _rows_from_columns(columns, signature, maybe_bool)
        return Decoded(inputs={}, rows=len(ragged), form=form, ragged=ragged)
    rows = {name: arr.shape[0] for name, arr in arrays.items()}
    if len(set(rows.values())) != 1:
        raise InvalidInputError(f"inputs have different row counts {rows}; all must be equal")
    return Decoded(inputs=arrays, rows=next(iter(rows.values())), form=form)


def _structure_quotes(payload: dict[str, Any], signature: ModelSignature) -> int:
    """The ``"`` the body's keys and ``signature_name`` take at least (the rows' keys checked
    already: each keyed row has one per input): a body with more may hold a string in its
    data (``serving.protocols.json_strings``)."""
    names = len(signature.inputs)
    quotes = 2 * len(payload) + (2 if isinstance(payload.get("signature_name"), str) else 0)
    instances = payload.get("instances")
    if isinstance(instances, list) and instances and isinstance(instances[0], dict):
        quotes += 2 * names * len(instances)
    elif isinstance(payload.get("inputs"), dict):
        quotes += 2 * names
    return quotes


def _refuse_strings(columns: dict[str, Any], signature: ModelSignature) -> None:
    """400 for an input whose data holds a string, before numpy makes an array of it (as wide
    as its longest string for every element)."""
    for spec in signature.inputs:
        if holds_string(columns[spec.name]):
            raise InvalidInputError(
                f"input {quote(spec.name)} holds strings; expected numbers {spec.describe()}"
            )


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
    return orjson.dumps({key: value}, option=orjson.OPT_SERIALIZE_NUMPY, default=_tolist)


def encode_rows(rows: list[dict[str, np.ndarray]], signature: ModelSignature) -> bytes:
    """The ``predictions`` of a ragged ``instances`` body: one row each, at its own length."""
    names = signature.output_names
    value: list[Any]
    if len(names) == 1:
        value = [row[names[0]] for row in rows]
    else:
        value = [{name: row[name] for name in names} for row in rows]
    return orjson.dumps({"predictions": value}, option=orjson.OPT_SERIALIZE_NUMPY, default=_tolist)


def _tolist(obj: Any) -> Any:
    # orjson writes C-contiguous arrays only: an output cut back to a row's length along a
    # later axis is a strided view (copied: orjson then writes it natively, several times
    # faster than a list of Python floats), and a scalar output's row a 0-d array.
    if isinstance(obj, np.ndarray):
        return obj[()] if obj.ndim == 0 else np.ascontiguousarray(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")


def takes_any_length(signature: ModelSignature) -> bool:
    """Whether some input of the model leaves a dimension unknown (rows may differ there)."""
    return any(None in spec.shape for spec in signature.inputs)


def _rows_from_columns(
    columns: dict[str, Any], signature: ModelSignature, maybe_bool: bool
) -> list[dict[str, np.ndarray]]:
    """Each instance decoded alone and checked against the spec with unknown dimensions
    free. Where the model takes no unknown length, the first row of another shape is refused
    (the rows cannot stack)."""
    fixed = not takes_any_length(signature)
    count = len(columns[signature.inputs[0].name])
    return [
        {
            spec.name: _row_array(columns[spec.name][i], spec, i, maybe_bool, fixed)
            for spec in signature.inputs
        }
        for i in range(count)
    ]


def _row_array(
    value: Any, spec: TensorSpec, index: int, maybe_bool: bool, fixed: bool
) -> np.ndarray:
    where = f"instance {index} of input {spec.name!r}"
    try:
        arr = np.asarray(value)
    except ValueError:
        raise InvalidInputError(
            f"{where} is ragged within itself (its own rows differ in length); the model takes "
            f"{spec.describe()}"
        ) from None
    _check_values(arr, value, spec, where, maybe_bool)
    if not spec.matches_row_shape(arr.shape):
        same = ": every row the same shape" if fixed else ""
        raise InvalidInputError(
            f"{where} has shape {_shape(arr.shape)}; the model takes {spec.describe()}{same}"
        )
    _check_range(arr, spec, where)
    return np.ascontiguousarray(arr, dtype=spec.np_dtype)


def _columnar_ragged(exc: _RaggedError, signature: ModelSignature) -> InvalidInputError:
    if not takes_any_length(signature):
        return InvalidInputError(exc.message)
    return InvalidInputError(
        f'{exc.message}. "inputs" (columns) takes rectangular arrays only: send rows of '
        'different lengths as "instances", one row (or object of inputs) each'
    )


def _shape(shape: tuple[int, ...]) -> str:
    return f"({shape[0]},)" if len(shape) == 1 else f"({', '.join(str(d) for d in shape)})"


def _columns_from_instances(
    instances: Any, signature: ModelSignature, limits: RequestLimits
) -> dict[str, Any]:
    if not isinstance(instances, list):
        raise InvalidInputError(
            f'"instances" must be a list of rows, got {type(instances).__name__}'
        )
    if not instances:
        raise InvalidInputError('"instances" is empty; send at least one row')
    limits.check_rows(len(instances))
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
    if len(obj) + len(missing) > len(names):
        extra = quote_all([key for key in obj if key not in names], sort=True)
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
        raise _RaggedError(
            f"{where} is ragged (rows of different lengths); expected {spec.describe()}"
        ) from None
    _check_values(arr, value, spec, where, maybe_bool)
    if not spec.matches_row_shape(arr.shape[1:]):
        got = ", ".join(str(d) for d in arr.shape)
        raise InvalidInputError(f"{where} has shape ({got}); expected {spec.describe()}")
    _check_range(arr, spec, where)
    return np.ascontiguousarray(arr, dtype=spec.np_dtype)


def _check_values(
    arr: np.ndarray, value: Any, spec: TensorSpec, where: str, maybe_bool: bool
) -> None:
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


def _check_range(arr: np.ndarray, spec: TensorSpec, where: str) -> None:
    if spec.np_dtype.kind in "iu" and arr.size:
        info = np.iinfo(spec.np_dtype)
        if arr.min() < info.min or arr.max() > info.max:
            raise InvalidInputError(f"{where} holds values outside the range of {spec.dtype}")


def _holds_bool(value: Any) -> bool:
    if isinstance(value, list):
        return any(_holds_bool(v) for v in value)
    return isinstance(value, bool)
