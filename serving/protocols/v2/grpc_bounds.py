"""A ``ModelInferRequest`` held to what its model's queue can take before protobuf parses it.

gRPC hands ``FromString`` the whole message (up to ``max_body_bytes``) and protobuf builds
every input, map entry and typed value it holds before our code runs: an 8 MiB message of
400,000 empty inputs cost 75 MiB and up to 0.6 s of the event loop, 3M packed typed values
34 MiB, all to be refused afterwards. ``scan_infer_request`` walks the wire format instead
(a field's tag, then its varint, fixed-size or length-prefixed value), which costs a step per
field and nothing per byte of a length-prefixed one, and refuses a message with more inputs,
outputs, parameters, shape dimensions or typed values than a request of ``max_queue_rows``
rows at the served length could hold (``serving.protocols.limits``): the same bound as an HTTP
body's. It stops at the first count over its limit, so the walk is bounded by what the model
takes, not by the message's size; a message within every bound is then parsed as before.

A packed run of typed values (what every protobuf 3 client sends) is counted without a step
per value: its length over 4 or 8 for floats and doubles, its bytes below 0x80 (the last byte
of each varint) for integers and booleans. Values sent one field each (legal, unusual) take a
step each, up to the limit. The model named in the message (``model_name``, field 1, first in
every serializer's output) gives the limits; where the name comes only after 256 other fields,
the message is refused and told to send it first.
"""

from __future__ import annotations

from collections.abc import Callable

from serving.errors import InvalidInputError
from serving.protocols.wire import DELIMITED as _DELIMITED
from serving.protocols.wire import InferBounds, Malformed, WireReader

__all__ = ["InferBounds", "scan_infer_request"]

# Room for what a client may add beyond one entry per input and output: request and tensor
# parameters (Triton's are a handful), and fields a newer client sends that we do not know.
_PARAMETER_SLACK = 64
_FIELDS_BEFORE_NAME = 256

# ModelInferRequest's fields (serving/protocols/v2/proto/grpc_service.proto).
_MODEL_NAME, _MODEL_VERSION, _INPUTS, _OUTPUTS = 1, 2, 5, 6
# InferInputTensor's.
_SHAPE, _CONTENTS = 3, 5
# InferTensorContents': packed varints (bool, int32, int64, uint32, uint64), fp32, fp64, bytes.
_VARINT_CONTENTS = frozenset({1, 2, 3, 4, 5})
_FP32_CONTENTS, _FP64_CONTENTS = 6, 7


def scan_infer_request(data: bytes, bounds_of: Callable[[str, str], InferBounds]) -> None:
    """``InvalidInputError`` for a serialized ``ModelInferRequest`` that holds more than
    ``bounds_of(model_name, model_version)`` allows, or is not a protobuf message;
    ``bounds_of`` raises what a lookup of the model raises (not found, still loading)."""
    try:
        _Scan(data, bounds_of).run()
    except Malformed as exc:
        raise InvalidInputError(
            f"the message is not a valid ModelInferRequest ({exc}); send one your client's "
            "V2 (KServe, Triton) stubs serialize"
        ) from None


class _Scan(WireReader):
    def __init__(self, data: bytes, bounds_of: Callable[[str, str], InferBounds]) -> None:
        super().__init__(data)
        self.bounds_of = bounds_of
        self.values = 0

    def run(self) -> None:
        name: str | None = None
        version = ""
        bounds: InferBounds | None = None
        counts = {_INPUTS: 0, _OUTPUTS: 0}
        inputs: list[tuple[int, int]] = []
        outputs: list[tuple[int, int]] = []
        fields = 0
        pos, end = 0, len(self.data)
        while pos < end:
            field, wire, pos, start = self.field(pos, end)
            fields += 1
            if field == _MODEL_NAME and wire == _DELIMITED:
                name = self.text(start, pos)
            elif field == _MODEL_VERSION and wire == _DELIMITED:
                version = self.text(start, pos)
            elif bounds is None and name is None and fields > _FIELDS_BEFORE_NAME:
                raise InvalidInputError(
                    f"the message has over {_FIELDS_BEFORE_NAME} fields before its model_name; "
                    "send model_name first (as every protobuf serializer writes it)"
                )
            if field > _MODEL_VERSION and bounds is None and name is not None:
                bounds = self.bounds_of(name, version)
            if field in counts:
                counts[field] += 1
                if wire == _DELIMITED:
                    (inputs if field == _INPUTS else outputs).append((start, pos))
            if bounds is not None:
                self.check_top(bounds, counts, fields)
        if bounds is None:
            bounds = self.bounds_of(name or "", version)
            self.check_top(bounds, counts, fields)
        for index, (start, stop) in enumerate(inputs):
            self.input(bounds, index, start, stop)
        for index, (start, stop) in enumerate(outputs):
            self.fields_within(start, stop, 1 + _PARAMETER_SLACK, f"output #{index}")

    def check_top(self, bounds: InferBounds, counts: dict[int, int], fields: int) -> None:
        if counts[_INPUTS] > bounds.inputs:
            raise InvalidInputError(
                f"the message has {counts[_INPUTS]}+ inputs; model {bounds.model!r} takes "
                f"{bounds.inputs}: send each of its inputs once"
            )
        if counts[_OUTPUTS] > bounds.outputs:
            raise InvalidInputError(
                f"the message asks for {counts[_OUTPUTS]}+ outputs; model {bounds.model!r} has "
                f"{bounds.outputs}: ask for each at most once"
            )
        most = 3 + 2 * bounds.inputs + bounds.outputs + _PARAMETER_SLACK
        if fields > most:
            raise InvalidInputError(
                f"the message has {fields}+ fields; a request to model {bounds.model!r} has at "
                f"most {most} (its name, version and id, an input, raw contents and output "
                f"each, and {_PARAMETER_SLACK} parameters)"
            )

    def input(self, bounds: InferBounds, index: int, pos: int, end: int) -> None:
        where = f"input #{index}"
        dims = fields = 0
        while pos < end:
            field, wire, pos, start = self.field(pos, end)
            fields += 1
            if field == _SHAPE:
                dims += self.varints(start, pos, bounds.rank) if wire == _DELIMITED else 1
                if dims > bounds.rank:
                    raise InvalidInputError(
                        f"{where} has a shape of {dims}+ dimensions; the inputs of model "
                        f"{bounds.model!r} have at most {bounds.rank} (rows first)"
                    )
            elif field == _CONTENTS and wire == _DELIMITED:
                self.contents(bounds, start, pos)
            if fields > 3 + bounds.rank + _PARAMETER_SLACK:
                raise InvalidInputError(
                    f"{where} has {fields}+ fields; an input has at most "
                    f"{3 + bounds.rank + _PARAMETER_SLACK} (its name, datatype, contents, shape "
                    f"and {_PARAMETER_SLACK} parameters)"
                )

    def contents(self, bounds: InferBounds, pos: int, end: int) -> None:
        """Every field counts one value at least: a message of empty packed runs would walk
        a step each, unbounded."""
        while pos < end:
            field, wire, pos, start = self.field(pos, end)
            if wire != _DELIMITED:
                count = 1  # one value (or an unknown field) sent on its own
            elif field in _VARINT_CONTENTS:
                count = self.varints(start, pos, bounds.values - self.values)
            elif field == _FP32_CONTENTS:
                count = (pos - start) // 4
            elif field == _FP64_CONTENTS:
                count = (pos - start) // 8
            else:
                count = 1  # an element of bytes_contents, or an unknown field
            self.values += max(count, 1)
            if self.values > bounds.values:
                raise InvalidInputError(
                    f"the message has {self.values}+ typed values in contents; a request to "
                    f"model {bounds.model!r} holds at most {bounds.values} (max_queue_rows rows "
                    "at max_sequence_length): send fewer rows per request"
                )

    def fields_within(self, pos: int, end: int, most: int, where: str) -> None:
        fields = 0
        while pos < end:
            _, _, pos, _ = self.field(pos, end)
            fields += 1
            if fields > most:
                raise InvalidInputError(
                    f"{where} has {fields}+ fields; an output has at most {most} (its name and "
                    f"{_PARAMETER_SLACK} parameters)"
                )
