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
has a tokenizer.

    POST /v2/models/{m}[/versions/{v}]/generate_stream   (the same body)
    ->  text/event-stream: data: {"model_name", "model_version", "text_output", "output_ids",
        "finish_reason"} per batch of new tokens (``finish_reason`` null until the last),
        data: {"error": message} for a failure after the first token

streams the same objects as tokens come (``serving.protocols.streaming``), ``text_output`` each
time the new tokens' text only (never half a UTF-8 character).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.types import Receive, Scope, Send

from serving.errors import InvalidInputError, ShardServeError
from serving.generation.request import encode_generate, parse_generate
from serving.generation.text_run import ChoiceDelta, TextRun
from serving.http.fast import FastRequest, ModelRef
from serving.http.replies import JSON, Reply
from serving.protocols.contract import ModelHandle, served_models
from serving.protocols.rest import serve_generation
from serving.protocols.streaming import EventSource, generation_deadline, stream_events

if TYPE_CHECKING:
    from serving.generation.engine import Generator

__all__ = ["generation_deadline", "v2_generate", "v2_generate_stream"]


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
    priority = _priority(request, call.priority, generator)
    done = await request.until_disconnect(
        generator.scheduler.generate(
            call.prompt,
            call.params,
            generation_deadline(request.timeout_ms, settings),
            priority=priority,
        )
    )
    tokenizer = generator.tokenizer
    answer = encode_generate(call, done, model.name, model.version, tokenizer)
    return 200, answer, JSON, []


def _priority(request: FastRequest, asked: object, generator: Generator) -> str:
    """``parameters.priority``, else the ``X-Priority`` header, else the default level."""
    try:
        return generator.scheduler.levels.resolve(asked, request.priority)
    except InvalidInputError as exc:
        if asked is None:
            raise
        raise InvalidInputError(f"parameters.{exc.message}") from None


async def v2_generate_stream(ref: ModelRef, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v2/models/{name}[/versions/{version}]/generate_stream`` (a fast route's
    ``RawHandler``)."""
    request = FastRequest(scope, receive, send)
    await serve_generation(request, served_models(scope["app"]), ref, _generate_stream)


async def _generate_stream(
    request: FastRequest, model: ModelHandle, generator: Generator, deadline: float
) -> Reply:
    settings = model.settings
    body = await request.body(settings.max_body_bytes, settings.body_read_timeout_s)
    call = parse_generate(body, generator.info, generator.tokenizer)
    priority = _priority(request, call.priority, generator)
    if generator.tokenizer is None:
        raise InvalidInputError(
            "generate_stream streams text and this model has no tokenizer; use generate"
        )
    run = TextRun(
        generator.scheduler,
        [call.prompt],
        call.params,
        generator.tokenizer,
        deadline=generation_deadline(request.timeout_ms, settings),
        priority=priority,
    )
    head = {"model_name": model.name, "model_version": model.version}

    def chunks(deltas: list[ChoiceDelta]) -> list[object]:
        return [
            {
                **head,
                "text_output": d.text,
                "output_ids": d.token_ids,
                "finish_reason": d.finish_reason,
            }
            for d in deltas
        ]

    def error(exc: ShardServeError) -> dict[str, Any]:
        return {"error": exc.message}

    source = EventSource(chunks, error, done=False)
    return await request.until_disconnect(stream_events(request, run, source))
