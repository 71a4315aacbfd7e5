"""A ``ModelInferRequest`` with more inputs or typed values than its model's queue can take is
refused before protobuf parses it (``serving.protocols.v2.grpc_bounds``), as an HTTP body is
before it is decoded; one at the limit is served.

Protobuf parses into its own arena, which ``tracemalloc`` does not see (its peak is the received
message, the same with the bound or without), so the cost of a parse is read from the process's
peak RSS: ``VmHWM``, reset through ``/proc/self/clear_refs`` right before the call. The message is
sent from a child process: the client's own copies of it (gRPC's send buffers) would count in
this process's peak too. The server's own copies of the received message still vary with the
allocator's state: 4 to 8 MiB for a 7.6 MiB message alone, 24 MiB late in the whole suite; so
whether protobuf parsed it is asked of the server itself (its parses counted), and the RSS is
held under four times the message (a parse added 25 to 43 MiB to it)."""

from __future__ import annotations

import asyncio
import logging
import sys
from asyncio.subprocess import PIPE
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from serving.errors import InvalidInputError
from serving.protocols.v2 import grpc_server
from serving.protocols.v2.grpc_bounds import InferBounds, scan_infer_request
from serving.protocols.v2.proto import grpc_service_pb2 as pb
from serving.protocols.v2.proto import grpc_service_pb2_grpc as pb_grpc
from shards.signature import ModelSignature, TensorSpec
from tests.fakes import WAIT_S, FakeRunner, make_rows
from tests.serving.protocols.v2.test_v2_grpc import failure, infer_request, rejects, serve

Tensor = pb.ModelInferRequest.InferInputTensor
TOKENS = ModelSignature(
    name="fake",
    inputs=(TensorSpec("tokens", (None,), "int32", pad_value=0),),
    outputs=(TensorSpec("y", (4,), "float32"),),
)
# 256 rows (max_queue_rows) of 512 tokens (the default max_sequence_length).
MOST_VALUES = 256 * 512
METHOD = "/inference.GRPCInferenceService/ModelInfer"
MiB = 1 << 20


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/self/status")


# The client, in a process of its own: it connects, says so, sends the message when told to, and
# prints the status and the details of the refusal.
_CLIENT = """
import sys
import grpc
channel = grpc.insecure_channel(sys.argv[1])
call = channel.unary_unary(sys.argv[2])
message = open(sys.argv[3], "rb").read()
try:
    call(b"")  # the channel is up
except grpc.RpcError:
    pass
print("ready", flush=True)
sys.stdin.readline()
try:
    call(message)
    print("ANSWERED")
except grpc.RpcError as exc:
    print(exc.code().name)
    print(exc.details() or "")
"""


class Parses:
    """``grpc_server``'s protobuf module as the server sees it, counting the parses of a
    ``ModelInferRequest``."""

    def __init__(self) -> None:
        self.count = 0
        parses = self

        class _Request:
            @staticmethod
            def FromString(data: bytes) -> pb.ModelInferRequest:
                parses.count += 1
                return pb.ModelInferRequest.FromString(data)

        self.ModelInferRequest = _Request

    def __getattr__(self, name: str) -> Any:
        return getattr(pb, name)


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Parses:
    counted = Parses()
    monkeypatch.setattr(grpc_server, "pb", counted)
    return counted


async def peak_growth(
    served_port: int, message: bytes, tmp_path: Path, parses: Parses
) -> tuple[int, int, grpc.StatusCode, str]:
    """(this process's peak RSS growth in bytes, the server's parses, status, details) of
    ``message`` sent as it is by a client in another process."""
    sent = tmp_path / "message.bin"
    sent.write_bytes(message)
    argv = ["-c", _CLIENT, f"127.0.0.1:{served_port}", METHOD, str(sent)]
    child = await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdin=PIPE, stdout=PIPE, stderr=PIPE
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        ready = await asyncio.wait_for(child.stdout.readline(), WAIT_S)
        assert ready == b"ready\n", (ready, await child.stderr.read() if child.stderr else b"")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        except OSError:
            pytest.skip("this kernel does not let a process reset its peak RSS")
        before = _status("VmRSS")
        parses.count = 0  # not the channel's first call
        child.stdin.write(b"go\n")
        await child.stdin.drain()
        out, err = await asyncio.wait_for(child.communicate(), WAIT_S)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    growth = _status("VmHWM") - before
    code, _, details = out.decode().partition("\n")
    assert child.returncode == 0 and code != "ANSWERED", (out, err[-2000:])
    return growth, parses.count, grpc.StatusCode[code], details.rstrip("\n")


async def test_a_message_of_400k_inputs_is_refused_before_it_is_parsed(
    tmp_path: Path, parses: Parses
) -> None:
    one = Tensor(name="tokens", datatype="INT32", shape=[1, 1])
    message = pb.ModelInferRequest(model_name="fake", inputs=[one] * 400_000).SerializeToString()
    assert len(message) > 7 * MiB
    async with serve(FakeRunner(TOKENS), max_queue_rows=256) as s:
        growth, parsed, code, details = await peak_growth(s.port, message, tmp_path, parses)
        assert rejects(s.state, "invalid_input") == 1
    assert parsed == 0
    # Refused, 8 MiB alone (the received message); parsed, it read 51 (protobuf's arena).
    assert growth < 4 * len(message), growth / MiB
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        details == "the message has 2+ inputs; model 'fake' takes 1: send each of its inputs once"
    )


async def test_a_message_of_7m_typed_values_is_refused_before_it_is_parsed(
    tmp_path: Path, parses: Parses
) -> None:
    tensor = Tensor(name="tokens", datatype="INT32", shape=[256, 512])
    tensor.contents.int_contents.extend(np.ones(7_000_000, np.int32).tolist())
    message = pb.ModelInferRequest(model_name="fake", inputs=[tensor]).SerializeToString()
    async with serve(FakeRunner(TOKENS), max_queue_rows=256) as s:
        growth, parsed, code, details = await peak_growth(s.port, message, tmp_path, parses)
    assert parsed == 0
    assert growth < 4 * len(message), growth / MiB  # refused alone: 4 to 7 MiB; parsed: 33 to 58
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"a request to model 'fake' holds at most {MOST_VALUES} (max_queue_rows" in details
    assert details.startswith("the message has 1048576+ typed values in contents")


async def test_a_request_at_the_limit_is_served(parses: Parses) -> None:
    tensor = Tensor(name="tokens", datatype="INT32", shape=[256, 512])
    tensor.contents.int_contents.extend([1] * MOST_VALUES)
    request = pb.ModelInferRequest(
        model_name="fake",
        inputs=[tensor],
        outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="y")],
    )
    request.parameters["timeout"].int64_param = 20_000_000
    async with serve(FakeRunner(TOKENS), max_queue_rows=256, max_batch_size=256) as s:
        response = await s.stub.ModelInfer(request)
    assert list(response.outputs[0].shape) == [256, 4]
    assert parses.count == 1  # the count sees a message the server parses


def test_values_sent_one_field_each_count_as_packed_ones() -> None:
    bounds = InferBounds(model="fake", inputs=1, outputs=1, rank=2, values=3)

    def message(values: int) -> bytes:
        contents = b"\x10\x01" * values  # int_contents (field 2), unpacked: a tag and a varint each
        tensor = b"\x0a\x06tokens" + b"\x2a" + bytes([len(contents)]) + contents
        return b"\x0a\x04fake" + b"\x2a" + bytes([len(tensor)]) + tensor

    scan_infer_request(message(3), lambda name, version: bounds)
    with pytest.raises(InvalidInputError, match=r"4\+ typed values in contents; .* at most 3"):
        scan_infer_request(message(4), lambda name, version: bounds)
    assert pb.ModelInferRequest.FromString(message(3)).inputs[0].contents.int_contents == [1] * 3


async def test_an_unexpected_error_is_logged_once_with_the_request_id(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("encoder bug")

    monkeypatch.setattr(grpc_server, "encode_outputs", broken)
    rows = make_rows(1)["x"]
    async with serve(FakeRunner(), batch_timeout_ms=0) as s:
        stub: pb_grpc.GRPCInferenceServiceStub = s.stub
        with caplog.at_level(logging.INFO, logger="shardserve"):
            code, details = await failure(
                stub.ModelInfer(infer_request(rows), metadata=(("x-request-id", "boom-1"),))
            )
    assert (code, details) == (
        grpc.StatusCode.INTERNAL,
        "internal server error; see the server log",
    )
    lines = [r for r in caplog.records if "boom-1" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].exc_info is not None  # with its traceback


def _parameters(count: int) -> dict[str, pb.InferParameter]:
    return {str(i): pb.InferParameter(bool_param=True) for i in range(count)}


@pytest.mark.parametrize(
    ("message", "words"),
    [
        (
            pb.ModelInferRequest(model_name="fake", parameters=_parameters(100)),
            "the message has 71+ fields; a request to model 'fake' has at most 70",
        ),
        (
            pb.ModelInferRequest(
                model_name="fake", inputs=[Tensor(name="tokens", parameters=_parameters(100))]
            ),
            "input #0 has 70+ fields; an input has at most 69",
        ),
        (
            pb.ModelInferRequest(
                model_name="fake",
                outputs=[
                    pb.ModelInferRequest.InferRequestedOutputTensor(
                        name="y", parameters=_parameters(100)
                    )
                ],
            ),
            "output #0 has 66+ fields; an output has at most 65",
        ),
        (
            pb.ModelInferRequest(model_name="fake", inputs=[Tensor(shape=[1] * 1000)]),
            "input #0 has a shape of 1000+ dimensions; the inputs of model 'fake' have at most 2",
        ),
        (
            pb.ModelInferRequest(outputs=[pb.ModelInferRequest.InferRequestedOutputTensor()] * 300),
            "the message has over 256 fields before its model_name; send model_name first",
        ),
    ],
    ids=["request-parameters", "input-parameters", "output-parameters", "shape", "name-last"],
)
def test_every_repeated_part_of_the_message_is_bounded(
    message: pb.ModelInferRequest, words: str
) -> None:
    bounds = InferBounds(model="fake", inputs=1, outputs=1, rank=2, values=MOST_VALUES)
    with pytest.raises(InvalidInputError) as refused:
        scan_infer_request(message.SerializeToString(), lambda name, version: bounds)
    assert words in refused.value.message


def test_bytes_that_are_no_message_are_invalid() -> None:
    bounds = InferBounds(model="fake", inputs=1, outputs=1, rank=2, values=MOST_VALUES)
    with pytest.raises(InvalidInputError, match="is not a valid ModelInferRequest"):
        scan_infer_request(b"\x0a\x04fake\xff", lambda name, version: bounds)


@pytest.mark.parametrize(
    "message",
    [b"\x0a\x04fake\xff", b"\x0a\x04fake\x1a\x02\xff\xfe"],
    ids=["cut-varint", "id-not-utf8"],
)
async def test_bytes_that_are_no_message_are_invalid_argument(message: bytes) -> None:
    """Not UNKNOWN naming protobuf's exception, as a deserializer that raised answered."""
    async with (
        serve(FakeRunner(TOKENS)) as s,
        grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as channel,
    ):
        code, details = await failure(channel.unary_unary(METHOD)(message))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("the message is not a valid ModelInferRequest (")
