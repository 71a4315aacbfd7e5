"""TF-Serving's predict routes, ``POST /predict`` and ``POST /v1/models/{name}[/versions/{v} or
/labels/{l}]:predict``: the JSON body of ``codec`` on the data plane over HTTP
(``serving.protocols.rest``); a ragged ``instances`` body as its rows
(``serving.protocols.ragged``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.types import Receive, Scope, Send

from serving.http.fast import FastRequest, ModelRef
from serving.http.replies import JSON, Reply
from serving.protocols.contract import ModelHandle, served_models
from serving.protocols.dataplane import submit, submit_ragged
from serving.protocols.limits import request_limits
from serving.protocols.rest import serve_prediction
from serving.protocols.tfserving.codec import decode_predict, encode_predict, encode_rows

if TYPE_CHECKING:
    from serving.batching.batcher import Batcher

__all__ = ["predict"]


async def predict(ref: ModelRef, scope: Scope, receive: Receive, send: Send) -> None:
    """A predict request for the model (version, label) ``ref`` names; maps its own errors (a
    fast route's ``RawHandler``)."""
    request = FastRequest(scope, receive, send)
    await serve_prediction(request, served_models(scope["app"]), ref, _predict)


async def _predict(
    request: FastRequest, model: ModelHandle, batcher: Batcher, deadline: float
) -> Reply:
    settings = model.settings
    body = await request.body(settings.max_body_bytes, settings.body_read_timeout_s)
    signature = model.signature
    # Inline, not on a thread: orjson and numpy hold the GIL while they parse, so a thread
    # stalled the loop as long and took no less time (bench looplag, docs/benchmarks.md).
    decoded = decode_predict(body, signature, request_limits(model, batcher))
    if decoded.ragged is not None:
        # Rows of different lengths: each its own request row, answered at its own length.
        rows = await request.until_disconnect(
            submit_ragged(decoded.ragged, model, batcher, deadline, request.request_id)
        )
        return 200, encode_rows(rows, signature), JSON, []
    outputs = await request.until_disconnect(
        submit(decoded.inputs, model, batcher, deadline, request.request_id)
    )
    return 200, encode_predict(outputs, signature, decoded.form), JSON, []
