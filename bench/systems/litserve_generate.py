"""LitServe batching generate requests (``python -m bench.systems.litserve_generate``): the
generation bench's peer, request-level batching.

Requests wait up to ``--batch-timeout-ms`` for a batch of ``--max-batch-size``; the batch runs
keras_hub's ``generate`` (``bench.systems.keras_generate``: padded to one shape, so it compiles
once) until its longest sequence ends, and every answer of the batch leaves at that moment. The
body is the server's generate body (``input_ids``, ``parameters.max_tokens``); the answer holds
``output_ids`` as the server's does.
"""

# No ``from __future__ import annotations``: LitServe reads decode_request's annotation at run
# time to build the request model, and a string annotation turns every request into a 422.
import argparse
from typing import Any

import litserve as ls

from bench import options
from bench.systems.keras_generate import Row


# At module level: LitServe pickles the API object into its spawned inference worker.
class GenerateAPI(ls.LitAPI):  # type: ignore[misc]
    def __init__(self, preset: str, length: int, max_batch_size: int, timeout_s: float) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=timeout_s)
        self.preset, self.length, self.rows = preset, length, max_batch_size

    def setup(self, device: str) -> None:
        from bench.systems.keras_generate import StaticGenerator

        self._generator = StaticGenerator(self.preset, self.rows, self.length)
        self._generator.generate([([1] * 16, 8)])  # compiles the one shape before any request

    def decode_request(self, request: dict) -> Row:  # type: ignore[type-arg]
        return (list(request["input_ids"]), int(request["parameters"]["max_tokens"]))

    def batch(self, inputs: list[Row]) -> list[Row]:
        return inputs

    def predict(self, rows: Any) -> list[list[int]]:
        if isinstance(rows, tuple):  # a single request that was not batched
            return self._generator.generate([rows])[0]  # type: ignore[return-value]
        return self._generator.generate(rows)

    def unbatch(self, output: list[list[int]]) -> list[list[int]]:
        return output

    def encode_response(self, output: list[int]) -> dict[str, Any]:
        return {"output_ids": output, "finish_reason": "length"}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.systems.litserve_generate")
    opts = options.Options(parser)
    opts.add("model", required=True, help="a keras_hub preset directory")
    opts.add("port", required=True, help="the port to serve on")
    opts.add("max_batch_size", required=True)
    opts.add("batch_timeout_ms", required=True)
    opts.own("--length", type=int, required=True, help="positions a batch is padded to")
    args = parser.parse_args()
    api = GenerateAPI(args.model, args.length, args.max_batch_size, args.batch_timeout_ms / 1000)
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, timeout=600)
    server.run(host="127.0.0.1", port=args.port, num_api_servers=1, generate_client_file=False)


if __name__ == "__main__":
    main()
