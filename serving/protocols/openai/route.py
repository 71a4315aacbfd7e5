"""What the OpenAI POST routes share: the body read before the data plane (its ``model`` names
the version to look up), the request's run of sequences (plain: collected; streamed:
``serving.protocols.streaming``), and the answer's common fields.

The body is read within the server's ``max_body_bytes`` and ``body_read_timeout_s`` (the model
is not known before it); the data plane then applies the model's own limits as for every route.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.types import Receive, Scope, Send

from serving.errors import InvalidInputError, ShardServeError
from serving.generation.text_run import ChoiceDelta, TextRun
from serving.http.admission import check_length
from serving.http.fast import FastRequest
from serving.http.replies import ClientGone, Reply, send_reply, unexpected_reply
from serving.protocols.contract import ModelHandle, served_models
from serving.protocols.dataplane import Failure, generate
from serving.protocols.openai.body import OpenAICall, load_object, model_ref
from serving.protocols.openai.errors import (
    FieldError,
    openai_error_reply,
    openai_unexpected_reply,
)
from serving.protocols.rest import RestTransport
from serving.protocols.streaming import generation_deadline
from serving.telemetry.stamp import CURRENT

if TYPE_CHECKING:
    from serving.generation.engine import Generator
    from serving.generation.tokenizer import TextTokenizer

__all__ = ["Collected", "OpenAIWork", "collect", "new_run", "serve_body", "usage"]

# (request, its parsed body, the model, its generator) -> the reply
OpenAIWork = Callable[[FastRequest, dict[str, Any], ModelHandle, "Generator"], Awaitable[Reply]]


async def serve_body(scope: Scope, receive: Receive, send: Send, work: OpenAIWork) -> None:
    """Read the body, look its ``model`` up through the data plane, answer with ``work``."""
    request = FastRequest(scope, receive, send)
    settings = scope["app"].state.shardserve.settings
    try:
        check_length(request.content_length, settings.max_body_bytes)
        body = await request.body(settings.max_body_bytes, settings.body_read_timeout_s)
        parsed = load_object(body)
        name, version, label = model_ref(parsed.get("model"))
    except ClientGone:
        return
    except ShardServeError as exc:
        await send_reply(send, request.rid, *openai_error_reply(exc, request.rid))
        return

    async def generate_work(
        request: FastRequest, model: ModelHandle, generator: Generator, deadline: float
    ) -> Reply:
        return await work(request, parsed, model, generator)

    await generate(
        served_models(scope["app"]),
        name,
        version,
        label,
        request,
        request.content_length,
        generate_work,
        _OPENAI,
    )


class _OpenAITransport(RestTransport):
    """The data plane over HTTP, its failures in OpenAI's shape."""

    __slots__ = ()

    def failure_reply(self, request: FastRequest, failure: Failure) -> Reply:
        if failure.error is not None:
            return openai_error_reply(failure.error, request.rid)
        if failure.unexpected is not None:
            unexpected_reply(request.scope, failure.unexpected)  # its log line
            return openai_unexpected_reply()
        return (499, b"", b"text/plain", [])  # the client went away: nobody reads it


_OPENAI = _OpenAITransport()


def tokenizer_of(generator: Generator) -> TextTokenizer:
    if generator.tokenizer is None:
        raise InvalidInputError(
            "this model has no tokenizer (its preset was saved without one): the OpenAI API "
            "answers text; generate token ids through POST /v2/models/{name}/generate"
        )
    return generator.tokenizer


def new_run(
    request: FastRequest, call: OpenAICall, model: ModelHandle, generator: Generator
) -> TextRun:
    """The request's run at its priority level: the body's ``priority``, else the
    ``X-Priority`` header's, else the default."""
    try:
        priority = generator.scheduler.levels.resolve(call.priority, request.priority)
    except InvalidInputError as exc:
        if call.priority is None:
            raise
        raise FieldError(exc.message, "priority") from None
    return TextRun(
        generator.scheduler,
        call.prompts,
        call.params,
        tokenizer_of(generator),
        call.stops,
        generation_deadline(request.timeout_ms, model.settings),
        priority,
    )


@dataclass
class Collected:
    """One choice's whole answer."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


async def collect(request: FastRequest, run: TextRun) -> list[Collected]:
    """Every choice's text once all have ended (a hang-up cancels them: ``ClientGone``)."""

    async def whole() -> list[Collected]:
        choices: dict[int, Collected] = {}
        try:
            run.start()
            while (deltas := await run.next()) is not None:
                for delta in deltas:
                    _add(choices.setdefault(delta.index, Collected()), delta)
        finally:
            await run.close()
            stamp = CURRENT.get()
            if stamp is not None:  # what the client got (not what a stop string cut off)
                stamp.tokens = run.completion_tokens
        return [choices[i] for i in sorted(choices)]

    return await request.until_disconnect(whole())


def _add(choice: Collected, delta: ChoiceDelta) -> None:
    choice.text += delta.text
    choice.token_ids += delta.token_ids
    choice.logprobs += delta.logprobs
    choice.finish_reason = delta.finish_reason or choice.finish_reason


def usage(run: TextRun) -> dict[str, int]:
    prompt, completion = run.prompt_tokens, run.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def head(kind: str, request: FastRequest, asked: object, model: ModelHandle) -> dict[str, Any]:
    """``id``, ``object``, ``created``, ``model`` (as asked; the name served when omitted)."""
    return {
        "id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{request.request_id}",
        "object": kind,
        "created": int(time.time()),
        "model": asked if isinstance(asked, str) else model.name,
    }
