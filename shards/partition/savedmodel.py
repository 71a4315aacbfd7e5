"""Read what serving needs from any TF SavedModel: its ``serving_default`` signature and the
bytes of the variables that signature uses.

Any exporter counts, not only Keras: ``tf.saved_model.save`` of a ``tf.Module`` restores as a
plain trackable object, with no ``variables`` of its own, so everything is read from the
signature's concrete function. A failure of TensorFlow's own while reading becomes one
``PartitionError`` naming the model by its directory's name: the message reaches ``/readyz``,
which no absolute path may reach.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

from shards.errors import PartitionError, one_line
from shards.signature import TensorSpec

log = logging.getLogger(__name__)

SIGNATURE_KEY = "serving_default"
# What the server decodes from JSON and the V2 protocol (serving.protocols.v2.datatypes): no
# strings.
SERVABLE_DTYPES = frozenset(
    {"bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"}
    | {"float16", "float32", "float64"}
)


class SavedModelInfo(NamedTuple):
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    weight_bytes: int


def read_savedmodel(path: Path) -> SavedModelInfo:
    """The signature's inputs and outputs (each sorted by name) and its variables' bytes."""
    name = path.name
    try:
        return _read(path, name)
    except PartitionError:
        raise
    except Exception as exc:
        # The full error (with the path) travels as the cause: the server logs it.
        log.debug("cannot read SavedModel %s", path, exc_info=True)
        raise PartitionError(f"cannot read SavedModel {name}: {_reason(exc)}") from exc


def _read(path: Path, name: str) -> SavedModelInfo:
    import tensorflow as tf

    loaded = tf.saved_model.load(str(path))
    signatures = dict(loaded.signatures)
    if SIGNATURE_KEY not in signatures:
        found = sorted(signatures) or "none"
        raise PartitionError(
            f"cannot read SavedModel {name}: it has no {SIGNATURE_KEY!r} signature (signatures: "
            f"{found}); export it with signatures={{{SIGNATURE_KEY!r}: ...}}"
        )
    fn = signatures[SIGNATURE_KEY]
    _, named_inputs = fn.structured_input_signature
    named_outputs = fn.structured_outputs
    inputs = tuple(_spec(name, "input", n, named_inputs[n]) for n in sorted(named_inputs))
    outputs = tuple(_spec(name, "output", n, named_outputs[n]) for n in sorted(named_outputs))
    # A variable the function captures twice is counted once.
    variables = {id(v): v for v in fn.variables}.values()
    weight_bytes = sum(int(v.shape.num_elements() or 0) * v.dtype.size for v in variables)
    return SavedModelInfo(inputs, outputs, weight_bytes)


def _spec(model: str, kind: str, name: str, spec: Any) -> TensorSpec:
    where = f"cannot read SavedModel {model}: {kind} {name!r} of {SIGNATURE_KEY!r}"
    dtype = spec.dtype.name
    if dtype not in SERVABLE_DTYPES:
        raise PartitionError(
            f"{where} is {dtype}; shardserve serves tensors of {sorted(SERVABLE_DTYPES)}"
        )
    if spec.shape.rank is None or spec.shape.rank == 0:
        shape = "of unknown rank" if spec.shape.rank is None else "a scalar"
        raise PartitionError(
            f"{where} is {shape}; requests are batched along a first dimension: export it with "
            "a TensorSpec of shape (None, ...)"
        )
    dims = spec.shape.as_list()
    if dims[0] is not None:
        raise PartitionError(
            f"{where} has a fixed first dimension {dims[0]}; requests are batched along it: "
            "export it with None there, e.g. TensorSpec((None, ...))"
        )
    return TensorSpec(name, tuple(dims[1:]), dtype)


def _reason(exc: BaseException) -> str:
    """The error's first line, scrubbed (absolute paths cut to their last part), without
    Python's type name where the message says more (a bare type name is all some errors have)."""
    text = one_line(exc)
    prefix = f"{type(exc).__name__}: "
    return text[len(prefix) :] if text.startswith(prefix) else text
