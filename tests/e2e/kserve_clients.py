"""Ask a shardserve server through the KServe SDK's V2 clients; print one ``RESULT {json}`` line.

    python tests/e2e/kserve_clients.py HTTP_URL GRPC_HOST:PORT MODEL INPUT ROWS_JSON

Run in its own process: the SDK's gRPC stubs and tritonclient's both register the protocol's
``inference`` messages in protobuf's default pool, so one process cannot import both.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest
from kserve.inference_client import RESTConfig


def _request(model: str, name: str, rows: np.ndarray, binary: bool) -> InferRequest:
    tensor = InferInput(name, list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows, binary_data=binary)
    return InferRequest(model_name=model, infer_inputs=[tensor])


async def main(http_url: str, grpc_url: str, model: str, name: str, rows_json: str) -> None:
    rows = np.asarray(json.loads(rows_json), dtype=np.float32)
    out: dict[str, Any] = {}
    rest = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
    try:
        out["rest_ready"] = [
            await rest.is_server_live(http_url),
            await rest.is_server_ready(http_url),
            await rest.is_model_ready(http_url, model),
        ]
        for binary in (False, True):
            answer = await rest.infer(http_url, _request(model, name, rows, binary), model)
            out[f"rest_binary_{binary}"] = answer.outputs[0].as_numpy().tolist()
    finally:
        await rest.close()
    grpc = InferenceGRPCClient(grpc_url, timeout=60)
    try:
        out["grpc_ready"] = [
            await grpc.is_server_live(),
            await grpc.is_server_ready(),
            await grpc.is_model_ready(model),
        ]
        answer = await grpc.infer(_request(model, name, rows, True))
        out["grpc"] = answer.outputs[0].as_numpy().tolist()
    finally:
        await grpc.close()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
