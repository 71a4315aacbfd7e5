"""protobuf's wire format read without parsing a message, and the most a request to a model may
hold: what each gRPC protocol's pre-parse bound (``serving.protocols.v2.grpc_bounds``,
``serving.protocols.tfserving.grpc_bounds``) walks a message with.

gRPC hands a deserializer the whole message (up to ``max_body_bytes``), and protobuf builds
every field it holds before our code runs. A walk of the wire format (a field's tag, then its
varint, fixed-size or length-prefixed value) costs a step per field and nothing per byte of a
length-prefixed one; a packed run of varints is counted by its bytes below 0x80 (the last byte
of each) a chunk at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from serving.protocols.limits import RequestLimits
from shards.signature import ModelSignature

__all__ = ["DELIMITED", "FIXED32", "FIXED64", "VARINT", "InferBounds", "Malformed", "WireReader"]

VARINT, FIXED64, DELIMITED, FIXED32 = 0, 1, 2, 5
_COUNT_CHUNK = 1 << 20
_CONTINUATION = bytes(range(0x80, 0x100))  # deleted, a packed varint run leaves one byte a value
_ONE_BYTE = bytes(0 if b < 0x80 else 1 for b in range(256))  # 0 for a byte that ends a varint


@dataclass(frozen=True)
class InferBounds:
    """What the largest request to a model holds, from its signature and ``RequestLimits``."""

    model: str
    inputs: int
    outputs: int
    rank: int
    values: int

    @classmethod
    def of(cls, model: str, signature: ModelSignature, limits: RequestLimits) -> InferBounds:
        per_row = sum(
            math.prod(limits.max_length if d is None else d for d in spec.shape)
            for spec in signature.inputs
        )
        return cls(
            model=model,
            inputs=len(signature.inputs),
            outputs=len(signature.outputs),
            rank=1 + max((len(spec.shape) for spec in signature.inputs), default=0),
            values=limits.max_rows * per_row,
        )


class Malformed(Exception):
    """Bytes that are not a protobuf message: protobuf refuses them too."""


class WireReader:
    """A serialized message's fields, read in place."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.view = memoryview(data)

    def field(self, pos: int, end: int) -> tuple[int, int, int, int]:
        """(field number, wire type, where the next field starts, where this one's value
        starts) of the field at ``pos``. A one-byte tag, varint or length (fields under 16,
        values under 128: most of every message) is read inline."""
        data = self.data
        if pos < end and data[pos] < 0x80:
            tag = data[pos]
            pos += 1
        else:
            tag, pos = self.varint(pos, end)
        wire = tag & 7
        start = pos
        if wire == VARINT:
            if pos < end and data[pos] < 0x80:
                pos += 1
            else:
                _, pos = self.varint(pos, end)
        elif wire == FIXED64:
            pos += 8
        elif wire == FIXED32:
            pos += 4
        elif wire == DELIMITED:
            if pos < end and data[pos] < 0x80:
                size, start = data[pos], pos + 1
            else:
                size, start = self.varint(pos, end)
            pos = start + size
        else:
            raise Malformed(f"wire type {wire}, which no field of it has")
        if pos > end or tag >> 3 == 0:
            raise Malformed("a field runs past the end of its message")
        return tag >> 3, wire, pos, start

    def varint(self, pos: int, end: int) -> tuple[int, int]:
        data = self.data
        value = shift = 0
        while pos < end and shift < 70:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, pos
            shift += 7
        raise Malformed("a varint runs past the end of its message")

    def varints(self, start: int, stop: int, most: int) -> int:
        """The varints packed in ``data[start:stop]`` (its bytes that end one), counted a chunk
        at a time so that a run over ``most`` stops after its first chunk over it."""
        count = 0
        for chunk in range(start, stop, _COUNT_CHUNK):
            piece = self.view[chunk : min(chunk + _COUNT_CHUNK, stop)].tobytes()
            count += len(piece.translate(None, _CONTINUATION))
            if count > most:
                break
        return count

    def repeats(self, pos: int, end: int, field: bytes, most: int) -> int:
        """How many fields shaped as ``field`` (the bytes of one: a one-byte tag, then a
        fixed-size value, a one-byte varint or a one-byte length and that many bytes) follow
        from ``pos`` on, at most ``most``: one field after another, each as long as ``field``,
        found with strided slices (no step per field: a message of 3M floats sent one field
        each was a 64 ms walk)."""
        stride = len(field)
        count = min(most, (end - pos) // stride)
        wire = field[0] & 7
        if count <= 0 or field[0] >= 0x80 or (wire == VARINT and stride != 2):
            return 0  # a tag or a varint of more bytes: fields alike may differ in length
        tags = self.view[pos : pos + count * stride : stride].tobytes()
        count -= len(tags.lstrip(field[:1]))
        if count and wire in (VARINT, DELIMITED):
            # the byte after the tag: a one-byte varint (< 0x80), or the same one-byte length
            second = self.view[pos + 1 : pos + count * stride : stride].tobytes()
            same = second.translate(_ONE_BYTE) if wire == VARINT else second
            count -= len(same.lstrip(b"\0" if wire == VARINT else field[1:2]))
        return count

    def varint_fields(self, pos: int, end: int, tag: int, most: int) -> tuple[int, int]:
        """(how many, where they end) of the varint fields of the one-byte ``tag`` that follow
        from ``pos`` on, whatever their lengths, at most ``most``: a tight loop, a third of a
        step through ``field`` each."""
        data = self.data
        count = 0
        while count < most and pos < end and data[pos] == tag:
            last = pos + 1
            while last < end and data[last] >= 0x80:
                last += 1
            if last >= end or last - pos > 10:
                break  # a varint past the end, or too long: ``field`` says what is wrong
            pos = last + 1
            count += 1
        return count, pos

    def text(self, start: int, stop: int) -> str:
        return self.view[start:stop].tobytes().decode("utf-8", "replace")
