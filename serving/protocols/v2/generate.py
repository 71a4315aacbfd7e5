"""The KServe/Triton generate extension over HTTP: text (or token ids) in, the completion out.

    POST /v2/models/{m}[/versions/{v}]/generate
        {"text_input": "...", "parameters": {"max_tokens": 16, "temperature": 0, ...}}
        or {"input_ids": [...], "parameters": {...}}
    ->  {"model_name", "model_version", "text_output", "output_ids", "finish_reason"}

Through the one data plane (``serving.protocols.dataplane.generate``): the look-up, admission
(a full prompt queue is 503 with Retry-After), the metrics and the error mapping are infer's;
the work reads the body, checks it (``serving.generation.request``: a 400 naming the field),
and awaits the version's scheduler until it answers, the client hangs up (its slot freed within
one step) or ``generation_timeout_ms`` passes (504). ``text_output`` is there where the model
has a tokenizer. Streaming and the OpenAI-compatible API are not served yet.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from starlette.types import Receive, Scope, Send

from serving.generation.request import encode_generate, parse_generate
from serving.http.fast import FastRequest, ModelRef
from serving.http.model import ModelHandle, served_models
from serving.http.replies import JSON, Reply
from serving.protocols.rest import serve_generation

if TYPE_CHECKING:
    from serving.generation.engine import Generator
    from serving.settings.config import Settings

__all__ = ["generation_deadline", "v2_generate"]


async def v2_generate(ref: ModelRef, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v2/models/{name}[/versions/{version}]/generate`` (a fast route's
    ``RawHandler``)."""
    request = FastRequest(scope, receive, send)
    await serve_generation(request, served_models(scope["app"]), ref, _generate)


async def _generate(
    request: FastRequest, model: ModelHandle, generator: Generator, deadline: float
) -> Reply:
    settings = model.settings
    body = await request.body(settings.max_body_bytes, settings.body_read_timeout_s)
    call = parse_generate(body, generator.info, generator.tokenizer)
    done = await request.until_disconnect(
        generator.scheduler.generate(
            call.prompt, call.params, generation_deadline(request.timeout_ms, settings)
        )
    )
    tokenizer = generator.tokenizer
    answer = encode_generate(call, done, model.name, model.version, tokenizer)
    return 200, answer, JSON, []


def generation_deadline(header: str | None, settings: Settings) -> float:
    """A generation's deadline (``time.monotonic()``): ``generation_timeout_ms`` from now, or the
    ``X-Request-Timeout-Ms`` header's if sooner (the transport has refused a malformed one)."""
    timeout_ms = settings.generation_timeout_ms
    if header is not None:
        try:
            asked = float(header)
        except ValueError:
            asked = math.inf
        if 0 < asked < math.inf:
            timeout_ms = min(timeout_ms, asked)
    return time.monotonic() + timeout_ms / 1000.0
