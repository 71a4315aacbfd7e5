"""V2 tensors of a model with an unknown length: ``[n, L]`` of any L up to max_sequence_length
is taken over HTTP and gRPC alike, and requests of different L join one queue (with length
padding, one batch), each answered for its own rows."""

from __future__ import annotations

import asyncio

import numpy as np

from serving.batching.lengths import LengthPadding, length_buckets
from serving.protocols.v2.proto import grpc_service_pb2 as pb
from shards.signature import ModelSignature, TensorSpec
from tests.fakes import FakeRunner, expected_outputs
from tests.serving.protocols.v2.test_v2_grpc import serve

TOKENS = ModelSignature(
    name="fake",
    inputs=(TensorSpec("ids", (None,), "int32"),),
    outputs=(TensorSpec("y", (2,), "float32"),),
)
LIMIT = 64


def tokens(rows: int, length: int, start: int) -> np.ndarray:
    return (np.arange(rows * length, dtype=np.int32).reshape(rows, length) + start).astype("<i4")


async def test_requests_of_different_lengths_share_a_batch_and_are_answered() -> None:
    runner = FakeRunner(TOKENS)
    # A full batch (2 rows) leaves at once; apart, each request would wait out the 10 s timeout.
    async with serve(
        runner, max_sequence_length=LIMIT, max_batch_size=2, batch_timeout_ms=10_000.0
    ) as s:
        metadata = (await s.http.get("/v2/models/fake")).json()
        assert metadata["inputs"] == [{"name": "ids", "datatype": "INT32", "shape": [-1, -1]}]
        batcher = s.state.model().batcher
        assert batcher is not None
        batcher.set_length_padding(
            LengthPadding(axes={"ids": 1}, pad_values={"ids": 0}, buckets=length_buckets(LIMIT))
        )
        before = len(runner.batches)
        short, long = tokens(1, 3, 1), tokens(1, LIMIT, 100)
        body = {
            "inputs": [{"name": "ids", "datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3]}]
        }
        tensor = pb.ModelInferRequest.InferInputTensor(
            name="ids", datatype="INT32", shape=long.shape
        )
        request = pb.ModelInferRequest(
            model_name="fake", inputs=[tensor], raw_input_contents=[long.tobytes()]
        )
        answer, reply = await asyncio.gather(
            s.http.post("/v2/models/fake/infer", json=body), s.stub.ModelInfer(request)
        )
        assert answer.status_code == 200, answer.text
        got_short = answer.json()["outputs"][0]
        assert got_short["shape"] == [1, 2]
        assert got_short["data"] == expected_outputs({"ids": short}, TOKENS)["y"].ravel().tolist()
        got_long = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(1, 2)
        np.testing.assert_array_equal(got_long, expected_outputs({"ids": long}, TOKENS)["y"])
        assert [b["ids"].shape for b in runner.batches[before:]] == [(2, LIMIT)]
