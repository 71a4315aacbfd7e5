"""A ``PredictRequest`` held to what its model's queue can take before protobuf parses it, as
V2's ``ModelInferRequest`` is (``serving.protocols.v2.grpc_bounds``; the walk of the wire
format is ``serving.protocols.wire``'s).

With the default deserializer a 12 MiB ``PredictRequest`` of unknown input keys held the event
loop for 3.6 s, and at 4.3 MB cost +168 MiB, all to be refused afterwards. The scan refuses a
message with more inputs (map entries), ``output_filter`` names, shape dimensions or typed
values than a request of ``max_queue_rows`` rows at the served length could hold, and a
``tensor_content`` longer than those values at the widest dtype; it stops at the first count
over its limit, so its walk is bounded by what the model takes, not by the message's size.
``resource_handle_val`` and ``variant_val`` (no served model takes them, and a variant nests
tensors in tensors) are refused unread. The model named in ``model_spec`` (field 1, first in
every serializer's output) gives the limits; where it comes only after 256 other fields, the
message is refused and told to send it first.
"""

from __future__ import annotations

from collections.abc import Callable

from serving.errors import InvalidInputError
from serving.protocols.wire import DELIMITED, VARINT, InferBounds, Malformed, WireReader
from serving.quoting import quote

__all__ = ["Selector", "scan_predict_request"]

# (name, version, label) of the ModelSpec, None where it leaves one out
Selector = tuple[str | None, str | None, str | None]

_SLACK = 16  # fields a newer client may send that we do not know
_FIELDS_BEFORE_SPEC = 256
_WIDEST = 8  # bytes of the widest element of tensor_content (int64, float64)

# PredictRequest's fields (serving/protocols/tfserving/proto/predict.proto).
_MODEL_SPEC, _INPUTS, _OUTPUT_FILTER = 1, 2, 3
# ModelSpec's: name, version (an Int64Value), signature_name, version_label.
_NAME, _VERSION, _LABEL = 1, 2, 4
# TensorProto's: the shape, the content's bytes, and the typed values by how they are packed.
_SHAPE, _CONTENT, _DIM = 2, 4, 2
_PACKED_4 = frozenset({5, 9})  # float_val, scomplex_val
_PACKED_8 = frozenset({6, 12})  # double_val, dcomplex_val
_PACKED_VARINT = frozenset({7, 10, 11, 13, 16, 17})  # int, int64, bool, half, uint32, uint64
_UNSERVED = {14: "resource_handle_val", 15: "variant_val"}


def scan_predict_request(data: bytes, bounds_of: Callable[[Selector], InferBounds]) -> None:
    """``InvalidInputError`` for a serialized ``PredictRequest`` that holds more than
    ``bounds_of(its model spec)`` allows, or is not a protobuf message; ``bounds_of`` raises
    what a lookup of the model raises (not found, still loading)."""
    try:
        _Scan(data, bounds_of).run()
    except Malformed as exc:
        raise InvalidInputError(
            f"the message is not a valid PredictRequest ({exc}); send one your client's "
            "TensorFlow Serving stubs serialize"
        ) from None


class _Scan(WireReader):
    def __init__(self, data: bytes, bounds_of: Callable[[Selector], InferBounds]) -> None:
        super().__init__(data)
        self.bounds_of = bounds_of
        self.values = 0

    def run(self) -> None:
        selector: Selector | None = None
        bounds: InferBounds | None = None
        inputs: list[tuple[int, int]] = []
        filters = fields = 0
        pos, end = 0, len(self.data)
        while pos < end:
            field, wire, pos, start = self.field(pos, end)
            fields += 1
            if field == _MODEL_SPEC and wire == DELIMITED:
                selector = self.model_spec(start, pos)
            elif bounds is None and selector is None and fields > _FIELDS_BEFORE_SPEC:
                raise InvalidInputError(
                    f"the message has over {_FIELDS_BEFORE_SPEC} fields before its model_spec; "
                    "send model_spec first (as every protobuf serializer writes it)"
                )
            if field != _MODEL_SPEC and bounds is None and selector is not None:
                bounds = self.bounds_of(selector)
            if field == _INPUTS and wire == DELIMITED:
                inputs.append((start, pos))
            elif field == _OUTPUT_FILTER:
                filters += 1
            if bounds is not None:
                self.check_top(bounds, len(inputs), filters, fields)
        if bounds is None:
            bounds = self.bounds_of(selector or (None, None, None))
            self.check_top(bounds, len(inputs), filters, fields)
        for start, stop in inputs:
            self.input(bounds, start, stop)

    def check_top(self, bounds: InferBounds, inputs: int, filters: int, fields: int) -> None:
        if inputs > bounds.inputs:
            raise InvalidInputError(
                f"the message has {inputs}+ inputs; model {quote(bounds.model)} takes "
                f"{bounds.inputs}: send each of its inputs once"
            )
        if filters > bounds.outputs:
            raise InvalidInputError(
                f"the message's output_filter names {filters}+ outputs; model "
                f"{quote(bounds.model)} has {bounds.outputs}: name each at most once"
            )
        most = 1 + bounds.inputs + bounds.outputs + _SLACK
        if fields > most:
            raise InvalidInputError(
                f"the message has {fields}+ fields; a request to model {quote(bounds.model)} "
                f"has at most {most} (its model_spec, an input and an output_filter name each)"
            )

    def model_spec(self, pos: int, end: int) -> Selector:
        name = version = label = None
        fields = 0
        while pos < end:
            field, wire, pos, start = self.field(pos, end)
            fields += 1
            if fields > 4 + _SLACK:
                raise InvalidInputError(
                    f"the message's model_spec has {fields}+ fields; it has at most 4 (name, "
                    "version or version_label, signature_name)"
                )
            if wire != DELIMITED:
                continue
            if field == _NAME:
                name = self.text(start, pos) or None
            elif field == _LABEL:
                label = self.text(start, pos) or None
            elif field == _VERSION:
                version = str(self.int64_value(start, pos))
        return name, version, label

    def int64_value(self, pos: int, end: int) -> int:
        """A ``google.protobuf.Int64Value``'s value (0 where it has none)."""
        value = 0
        fields = 0
        while pos < end:
            field, wire, pos, start = self.field(pos, end)
            fields += 1
            if fields > 1 + _SLACK:
                raise InvalidInputError("the message's model_spec.version has too many fields")
            if field == 1 and wire == VARINT:
                value, _ = self.varint(start, pos)
        return value - (1 << 64) if value >= 1 << 63 else value  # int64: two's complement

    def input(self, bounds: InferBounds, pos: int, end: int) -> None:
        """One ``inputs`` map entry: its key (1) and its ``TensorProto`` (2)."""
        fields = 0
        while pos < end:
            field, wire, pos, start = self.field(pos, end)
            fields += 1
            if fields > 2 + _SLACK:
                raise InvalidInputError(
                    f"an entry of inputs has {fields}+ fields; it has 2 (its key and tensor)"
                )
            if field == 2 and wire == DELIMITED:
                self.tensor(bounds, start, pos)

    def tensor(self, bounds: InferBounds, pos: int, end: int) -> None:
        """Every field counts one value at least (an empty packed run too), so that the walk
        is bounded by the values a request may hold."""
        dims = 0
        data = self.data
        while pos < end:
            begin = pos
            field, wire, pos, start = self.field(pos, end)
            if field in _UNSERVED:
                raise InvalidInputError(
                    f"an input has {_UNSERVED[field]}, which no served model takes; send "
                    "numbers in tensor_content or the typed field of their dtype"
                )
            if field == _SHAPE and wire == DELIMITED:
                dims += self.shape(bounds, start, pos, dims)  # repeated shapes merge
                count = 1
            elif field == _CONTENT and wire == DELIMITED:
                most = bounds.values * _WIDEST
                if pos - start > most:
                    raise InvalidInputError(
                        f"an input has {pos - start} bytes of tensor_content; a request to model "
                        f"{quote(bounds.model)} holds at most {bounds.values} values "
                        f"({most} bytes): send fewer rows per request"
                    )
                count = 1
            elif wire != DELIMITED:
                count = 1  # one value (or the dtype, or an unknown field) sent on its own
            elif field in _PACKED_VARINT:
                count = self.varints(start, pos, bounds.values - self.values)
            elif field in _PACKED_4:
                count = (pos - start) // 4
            elif field in _PACKED_8:
                count = (pos - start) // 8
            elif field == 18:  # float8_val: a value a byte
                count = pos - start
            else:
                count = 1  # an element of string_val, or an unknown field
            self.values += max(count, 1)
            # Only a field whose next one has its tag may start a run (one comparison).
            if (
                pos < end
                and data[pos] == data[begin]
                and self.values <= bounds.values
                and field not in (_SHAPE, _CONTENT)
            ):
                pos = self.skip_repeats(bounds, begin, pos, end, field, wire)
            if self.values > bounds.values:
                raise InvalidInputError(
                    f"the message has {self.values}+ typed values; a request to model "
                    f"{quote(bounds.model)} holds at most {bounds.values} (max_queue_rows rows "
                    "at max_sequence_length): send fewer rows per request"
                )

    def skip_repeats(
        self, bounds: InferBounds, begin: int, pos: int, end: int, field: int, wire: int
    ) -> int:
        """Past the fields after ``data[begin:pos]`` shaped as it, each counted as it would
        be (a value each; a packed run's values by its length, or its varints' last bytes)."""
        one = self.data[begin:pos]
        if len(one) > 130:  # a tag and a one-byte length: at most 127 bytes of value
            return pos
        most = bounds.values - self.values + 1
        runs = self.repeats(pos, end, one, most)
        if not runs and wire == VARINT and one[0] < 0x80:  # values of different lengths
            runs, stop = self.varint_fields(pos, end, one[0], most)
            self.values += runs
            return stop
        if not runs:
            return pos
        stop = pos + runs * len(one)
        if wire != DELIMITED or field not in _PACKED_VARINT | _PACKED_4 | _PACKED_8 | {18}:
            self.values += runs
        elif field in _PACKED_VARINT:  # a tag and a length byte each end "a varint" too
            self.values += max(self.varints(pos, stop, most + 2 * runs) - 2 * runs, runs)
        else:
            each = len(one) - 2
            self.values += runs * max(
                each // (4 if field in _PACKED_4 else 8 if field in _PACKED_8 else 1), 1
            )
        return stop

    def shape(self, bounds: InferBounds, pos: int, end: int, before: int) -> int:
        """The dimensions of one ``tensor_shape`` field (``before``: of those before it)."""
        dims = fields = 0
        while pos < end:
            field, wire, pos, start = self.field(pos, end)
            fields += 1
            if field == _DIM:
                dims += 1
                if wire == DELIMITED:
                    self.dim(start, pos)
            if before + dims > bounds.rank:
                raise InvalidInputError(
                    f"an input has a shape of {before + dims}+ dimensions; the inputs of model "
                    f"{quote(bounds.model)} have at most {bounds.rank} (rows first)"
                )
            if fields > bounds.rank + 1 + _SLACK:
                raise InvalidInputError(f"an input's tensor_shape has {fields}+ fields")
        return dims

    def dim(self, pos: int, end: int) -> None:
        fields = 0
        while pos < end:
            _, _, pos, _ = self.field(pos, end)
            fields += 1
            if fields > 2 + _SLACK:
                raise InvalidInputError(
                    f"a dimension of an input's shape has {fields}+ fields; it has a size"
                )
