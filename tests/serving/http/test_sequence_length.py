"""A request longer than ``max_sequence_length`` in a dimension the model leaves unknown is
refused with 400 and the reason, in every protocol (TF-Serving JSON, V2 JSON, V2 gRPC); one at
the limit is served. A model with fixed shapes never hits the check."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from serving.protocols.v2.proto import grpc_service_pb2 as pb
from shards.signature import ModelSignature, TensorSpec
from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner
from tests.serving.protocols.v2.test_v2_grpc import serve as serve_grpc
from tests.serving.served_app import serve

TOKENS = ModelSignature(
    name="fake",
    inputs=(TensorSpec("ids", (None,), "int32"),),
    outputs=(TensorSpec("y", (2,), "float32"),),
)
LIMIT = 8
REASON = "input 'ids' has shape (1, 9): length 9 in dimension 1 is over max_sequence_length=8"


def ids(length: int) -> list[list[int]]:
    return [list(range(1, length + 1))]


async def test_tfserving_refuses_a_row_over_the_limit_and_serves_one_at_it() -> None:
    runner = FakeRunner(TOKENS)
    async with serve(runner, max_sequence_length=LIMIT, batch_timeout_ms=0) as client:
        warm_up = runner.batches[0]["ids"]
        assert warm_up.shape == (1, LIMIT)
        r = await client.post("/v1/models/fake:predict", json={"instances": ids(LIMIT + 1)})
        assert r.status_code == 400
        assert REASON in r.json()["error"]
        assert_clean_error(r.json())
        ok = await client.post("/v1/models/fake:predict", json={"instances": ids(LIMIT)})
        assert ok.status_code == 200, ok.text
        assert len(runner.batches) == 2  # the warm-up and the row at the limit


async def test_v2_json_refuses_a_tensor_over_the_limit() -> None:
    runner = FakeRunner(TOKENS)
    async with serve(runner, max_sequence_length=LIMIT, batch_timeout_ms=0) as client:

        def body(length: int) -> dict[str, object]:
            tensor = {"name": "ids", "datatype": "INT32", "shape": [1, length]}
            return {"inputs": [{**tensor, "data": ids(length)[0]}]}

        r = await client.post("/v2/models/fake/infer", json=body(LIMIT + 1))
        assert r.status_code == 400
        assert REASON in r.json()["error"]
        ok = await client.post("/v2/models/fake/infer", json=body(LIMIT))
        assert ok.status_code == 200, ok.text


async def test_v2_grpc_refuses_a_tensor_over_the_limit() -> None:
    async with serve_grpc(FakeRunner(TOKENS), max_sequence_length=LIMIT) as s:
        rows = np.array(ids(LIMIT + 1), dtype="<i4")
        tensor = pb.ModelInferRequest.InferInputTensor(
            name="ids", datatype="INT32", shape=rows.shape
        )
        request = pb.ModelInferRequest(
            model_name="fake", inputs=[tensor], raw_input_contents=[rows.tobytes()]
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.stub.ModelInfer(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert REASON in str(info.value.details())


async def test_fixed_shapes_are_never_over_the_limit() -> None:
    async with serve(FakeRunner(), max_sequence_length=1, batch_timeout_ms=0) as client:
        r = await client.post("/v1/models/fake:predict", json={"instances": [[1.0, 2, 3, 4]]})
        assert r.status_code == 200, r.text


BOUNDED = ModelSignature(
    name="fake",
    inputs=(TensorSpec("ids", (None,), "int32", pad_value=0, max_length=32),),
    outputs=(TensorSpec("y", (2,), "float32"),),
)


async def test_with_no_flag_the_models_own_bound_is_the_limit() -> None:
    """A position embedding of 32 rows (issue 27): warmed at 32, not 512; length buckets up to
    32; a row of 33 refused naming 32, one of 32 served."""
    runner = FakeRunner(BOUNDED)
    async with serve(runner, batch_timeout_ms=0) as client:
        assert runner.batches[0]["ids"].shape == (1, 32)
        assert max(b["ids"].shape[1] for b in runner.batches) == 32  # the length check's too
        meta = (await client.get("/v2/models/fake")).json()
        assert meta["parameters"]["length_padding"]["buckets"] == [16, 32]
        r = await client.post("/v1/models/fake:predict", json={"instances": ids(33)})
        assert r.status_code == 400
        assert "length 33 in dimension 1 is over max_sequence_length=32" in r.json()["error"]
        assert_clean_error(r.json())
        ok = await client.post("/v1/models/fake:predict", json={"instances": ids(32)})
        assert ok.status_code == 200, ok.text
