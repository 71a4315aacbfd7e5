"""The most a request can hold, from what the model's queue takes, and the checks that refuse a
bigger one before it costs per-row work or memory (every protocol, every transport).

A request never holds more than ``max_queue_rows`` rows (a bigger one could never be queued),
and a dimension the model leaves unknown is at most ``max_sequence_length`` long. Three checks
hold a body to that, each before the work it saves:

1. **a JSON body's bytes, before it is parsed** (``check_json``): orjson builds a Python object
   for every value, so a 1 MB TF-Serving body of 200,000 rows of ``[1]`` cost 24 MB and 0.6 s
   to parse (a 16 MiB one 500 MB), before any count could refuse it. Its ``[`` and ``{`` bound
   its arrays and objects, its commas its values; ``bytes.count`` reads them at memory speed,
   without a Python object (~7 ms per count of 16 MiB on this machine, and only for a body long
   enough to hold too many);
2. **the row count, right after parsing** (``check_rows``): before a dict or array per row,
   before padding (``decode`` of 200,001 ragged rows then padding each took 5.6 s and 900 MB);
3. **each declared dimension, before an array is shaped** (``check_dims``): a V2 shape is the
   client's word, and ``[2**62, 0]`` passed every count (0 elements) then failed ``reshape``.
   With every dimension bounded, so is their product.

The bounds are generous (a request at the limit always passes, whatever its layout): they only
have to keep the work proportional to what the queue can take, not to the body's size.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serving.errors import InvalidInputError
from serving.settings.config import default_queue_rows
from serving.settings.lengths import served_max_length
from shards.partition.memory_plan import DEFAULT_MAX_SEQUENCE_LENGTH
from shards.signature import ModelSignature, TensorSpec

if TYPE_CHECKING:
    from serving.batching.batcher import Batcher
    from serving.protocols.contract import ModelHandle

__all__ = ["DEFAULT_LIMITS", "RequestLimits", "request_limits"]

# Room for what is not rows: the root object, "instances"/"inputs", V2's input and output
# entries with their shape lists, parameters and a client's own request parameters.
_FIXED_SLACK = 64
_PER_TENSOR_SLACK = 16
_COUNT_CHUNK = 1 << 20
# json_bounds per (max_rows, max_length, the signature's identity), with the signature held so
# that its identity is not reused: every request asks, for the same few signatures.
_BOUNDS: dict[tuple[int, int, int], tuple[ModelSignature, tuple[int, int]]] = {}
_BOUNDS_KEPT = 64


@dataclass(frozen=True)
class RequestLimits:
    """``max_rows``: the model's ``max_queue_rows`` now; ``max_length``: its
    ``max_sequence_length``, the longest a dimension the model leaves unknown may be."""

    max_rows: int
    max_length: int

    def check_rows(self, rows: int) -> None:
        """400 for more rows than the queue could ever take (the batcher's own words)."""
        if rows > self.max_rows:
            raise InvalidInputError(
                f"request has {rows} rows; at most {self.max_rows} (max_queue_rows) fit: send at "
                f"most {self.max_rows} rows per request"
            )

    def check_dims(self, where: str, dims: tuple[int, ...], spec: TensorSpec) -> None:
        """400 for a declared shape (rows first) with more rows than fit, or longer than
        ``max_length`` where the model leaves a dimension unknown; ``dims`` already match the
        model's fixed dimensions."""
        shown = f"({', '.join(str(d) for d in dims)})"  # as the data plane's length check writes it
        if dims and dims[0] > self.max_rows:
            raise InvalidInputError(
                f"{where} has shape {shown}: {dims[0]} rows, over max_queue_rows={self.max_rows}, "
                f"the most a request may hold; send at most {self.max_rows} rows"
            )
        for axis, want in enumerate(spec.shape, start=1):
            if want is None and axis < len(dims) and dims[axis] > self.max_length:
                raise InvalidInputError(
                    f"{where} has shape {shown}: length {dims[axis]} in dimension {axis} is over "
                    f"max_sequence_length={self.max_length}, the longest this server takes; "
                    f"send at most {self.max_length}"
                )

    def check_json(
        self, body: bytes | bytearray, signature: ModelSignature, end: int | None = None
    ) -> None:
        """400 for the JSON ``body[:end]`` with more arrays and objects, or more values, than
        a request of ``max_rows`` rows at ``max_length`` could hold, however it is laid out.

        Counted a chunk at a time, so that a body made of brackets or commas is refused after
        its first chunk, not its last."""
        size = len(body) if end is None else end
        containers, values = self.json_bounds(signature)
        # A value takes a byte and its separator another: a short body cannot hold too many.
        if size // 2 + 1 <= containers:
            return
        opened = commas = 0
        for start in range(0, size, _COUNT_CHUNK):
            stop = min(start + _COUNT_CHUNK, size)
            opened += body.count(b"[", start, stop) + body.count(b"{", start, stop)
            if opened > containers:
                raise InvalidInputError(
                    f"the body holds {opened}+ JSON arrays and objects ('[' and '{{'); a request "
                    f"of at most {self.max_rows} rows (max_queue_rows) of {_rows_of(signature)} "
                    f"holds at most {containers}: send at most {self.max_rows} rows per request"
                )
            commas += body.count(b",", start, stop)
            if commas > values:
                raise InvalidInputError(
                    f"the body holds {commas}+ JSON values (commas); a request of at most "
                    f"{self.max_rows} rows (max_queue_rows) of {_rows_of(signature)} holds at "
                    f"most {values}: send at most {self.max_rows} rows per request, each at most "
                    f"{self.max_length} long (max_sequence_length)"
                )

    def json_bounds(self, signature: ModelSignature) -> tuple[int, int]:
        """(arrays and objects, values) that the JSON of the largest request may hold: each
        input of each row nested as its shape (a list per dimension but the last), an object
        per row (keyed rows), and every element followed by a comma (an upper bound)."""
        key = (self.max_rows, self.max_length, id(signature))
        held = _BOUNDS.get(key)
        if held is not None and held[0] is signature:
            return held[1]
        scalars = containers = 0
        for spec in signature.inputs:
            dims = [self.max_length if d is None else d for d in spec.shape]
            scalars += math.prod(dims)
            containers += sum(math.prod(dims[:level]) for level in range(len(dims)))
        containers += 1  # the row's own object, when rows are keyed by input name
        tensors = len(signature.inputs) + len(signature.outputs)
        slack = _FIXED_SLACK + _PER_TENSOR_SLACK * tensors
        per_row_values = scalars + containers + len(signature.inputs)  # + the keys of a row
        bounds = self.max_rows * containers + slack, self.max_rows * per_row_values + slack
        if len(_BOUNDS) >= _BOUNDS_KEPT:
            _BOUNDS.clear()
        _BOUNDS[key] = (signature, bounds)
        return bounds


DEFAULT_LIMITS = RequestLimits(default_queue_rows(32, 2), DEFAULT_MAX_SEQUENCE_LENGTH)
"""A server's defaults (one stage, batches of 32): for a caller without a model (tools, tests)."""


def request_limits(model: ModelHandle, batcher: Batcher) -> RequestLimits:
    """The limits of a request to ``model`` now: ``max_queue_rows`` as a reconfigure left it,
    the length ``serving.protocols.dataplane.submit`` holds decoded arrays to."""
    length = served_max_length(model.settings.max_sequence_length, model.signature)
    return _limits(batcher.settings.max_queue_rows, length)


@functools.lru_cache(maxsize=64)
def _limits(max_rows: int, max_length: int) -> RequestLimits:
    # One per (rows, length): a request's limits cost a look up, not a dataclass of their own.
    return RequestLimits(max_rows, max_length)


def _rows_of(signature: ModelSignature) -> str:
    return ", ".join(f"{spec.name!r} {spec.describe()}" for spec in signature.inputs)
