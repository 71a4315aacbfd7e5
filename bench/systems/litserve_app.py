"""LitServe serving the ``.keras`` file with its own batching (``python -m bench.systems.litserve_app``).

The model runs in a ``tf.function`` with a fixed input signature, as shardserve's shard actors
run it, so the comparison is about serving, not about eager Keras calls.
"""

# No ``from __future__ import annotations``: LitServe reads decode_request's annotation at run
# time to build the request model, and a string annotation turns every request into a 422.
from typing import Any

import litserve as ls
import numpy as np

from bench.systems.base import peer_args


# At module level: LitServe pickles the API object into its spawned inference worker.
class KerasAPI(ls.LitAPI):  # type: ignore[misc]
    def __init__(self, model_path: str, max_batch_size: int, batch_timeout_s: float) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout_s)
        self.model_path = model_path

    def setup(self, device: str) -> None:
        import keras
        import tensorflow as tf

        model = keras.saving.load_model(self.model_path, compile=False)
        self._rank = len(model.input_shape)
        spec = tf.TensorSpec((None, *model.input_shape[1:]), tf.float32)
        self._step = tf.function(lambda x: model(x, training=False), input_signature=[spec])

    def decode_request(self, request: dict) -> np.ndarray:  # type: ignore[type-arg]
        return np.asarray(request["instances"][0], dtype=np.float32)

    def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
        return np.stack(inputs)

    def predict(self, x: np.ndarray) -> np.ndarray:
        if x.ndim == self._rank - 1:  # a single request that was not batched
            return np.asarray(self._step(x[None]))[0]
        return np.asarray(self._step(x))

    def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
        return list(output)

    def encode_response(self, output: np.ndarray) -> dict[str, Any]:
        return {"predictions": [output.tolist()]}


def main() -> None:
    args = peer_args()
    api = KerasAPI(args.model, args.max_batch_size, args.batch_timeout_ms / 1000.0)
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, timeout=60)
    server.run(host="127.0.0.1", port=args.port, num_api_servers=1, generate_client_file=False)


if __name__ == "__main__":
    main()
