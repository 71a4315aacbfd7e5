"""Ray Serve serving the ``.keras`` file with ``@serve.batch`` (``python -m bench.systems.rayserve_app``).

It starts its own private Ray (``address="local"``), never attaches to another one, and shuts
Serve and Ray down on SIGTERM.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import numpy as np

from bench.systems.base import peer_args


def _deployment(max_batch_size: int, batch_timeout_s: float) -> Any:
    from ray import serve
    from starlette.requests import Request

    # max_ongoing_requests caps what reaches the replica; below the batch size no batch could
    # ever fill, so it gets room for two full batches.
    @serve.deployment(num_replicas=1, max_ongoing_requests=2 * max_batch_size)
    class KerasModel:
        def __init__(self, model_path: str) -> None:
            import keras
            import tensorflow as tf

            model = keras.saving.load_model(model_path, compile=False)
            spec = tf.TensorSpec((None, *model.input_shape[1:]), tf.float32)
            self._step = tf.function(lambda x: model(x, training=False), input_signature=[spec])

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=batch_timeout_s)
        async def predict(self, rows: list[np.ndarray]) -> list[np.ndarray]:
            return list(np.asarray(self._step(np.stack(rows))))

        async def __call__(self, request: Request) -> dict[str, Any]:
            body = await request.json()
            row = np.asarray(body["instances"][0], dtype=np.float32)
            output = await self.predict(row)
            return {"predictions": [output.tolist()]}

    return KerasModel


def main() -> None:
    import ray
    from ray import serve

    args = peer_args()
    stop = threading.Event()
    ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        app = _deployment(args.max_batch_size, args.batch_timeout_ms / 1000.0).bind(args.model)
        serve.run(app, route_prefix="/predict")
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
