"""``POST /v1/completions``: OpenAI's completions API.

    {"model": "gpt", "prompt": "the cat" | [464, 2068] | ["a", "b"] | [[1, 2], [3]],
     "max_tokens": 16, "temperature": 1, "top_p": 1, "top_k": 0, "seed": 7,
     "stop": "\\n" | ["\\n", "."], "logprobs": 0 | 1, "stream": false,
     "stream_options": {"include_usage": true}}
->  {"id", "object": "text_completion", "created", "model",
     "choices": [{"index", "text", "finish_reason": "stop" | "length", "logprobs"}],
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}

Each prompt of a list is its own choice (its own sequence, generated beside the others). A stop
string cuts the text before it (``finish_reason`` ``"stop"``), as does the model's end token.
``logprobs``: each generated token's log-probability under the sampling distribution (with
``temperature`` 0, the top-1's); ``top_logprobs`` holds that one token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from starlette.types import Receive, Scope, Send

from serving.errors import ShardServeError
from serving.generation.text_run import ChoiceDelta
from serving.http.fast import FastRequest, ModelRef
from serving.http.replies import JSON, Reply
from serving.protocols.contract import ModelHandle
from serving.protocols.openai.body import (
    DEFAULT_MAX_TOKENS,
    OpenAICall,
    check_fields,
    check_prompt_length,
    generation_params,
    prompts_of,
    stream_flags,
)
from serving.protocols.openai.errors import FieldError, error_object
from serving.protocols.openai.route import (
    Collected,
    collect,
    head,
    new_run,
    serve_body,
    tokenizer_of,
    usage,
)
from serving.protocols.streaming import EventSource, stream_events

if TYPE_CHECKING:
    from serving.generation.engine import Generator
    from serving.generation.tokenizer import TextTokenizer

__all__ = ["v1_completions"]

_OWN = frozenset({"prompt", "logprobs"})


async def v1_completions(ref: ModelRef, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/completions`` (a fast route's ``RawHandler``; the model is the body's)."""
    await serve_body(scope, receive, send, _complete)


def parse_completion(
    request: dict[str, Any], generator: Generator, tokenizer: TextTokenizer
) -> OpenAICall:
    check_fields(request, _OWN)
    info = generator.info
    if "prompt" not in request:
        raise FieldError("prompt is missing: send a string or a list of token ids", "prompt")
    prompts = prompts_of(request["prompt"], info, tokenizer)
    for index, prompt in enumerate(prompts):
        check_prompt_length(prompt, info, "prompt" if len(prompts) == 1 else f"prompt[{index}]")
    params, stops = generation_params(
        request, max(len(p) for p in prompts), info, DEFAULT_MAX_TOKENS
    )
    logprobs = request.get("logprobs")
    if logprobs is not None and (
        not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= 1
    ):
        raise FieldError(
            f"logprobs is {logprobs!r}; this server gives the sampled token's log-probability "
            "(logprobs 0 or 1), not more alternatives",
            "logprobs",
        )
    stream, include_usage = stream_flags(request)
    return OpenAICall(
        tuple(prompts),
        params,
        stops,
        stream,
        include_usage,
        logprobs is not None,
        request.get("priority"),
    )


async def _complete(
    request: FastRequest, body: dict[str, Any], model: ModelHandle, generator: Generator
) -> Reply:
    tokenizer = tokenizer_of(generator)
    call = parse_completion(body, generator, tokenizer)
    run = new_run(request, call, model, generator)
    top = head("text_completion", request, body.get("model"), model)
    if call.stream:

        def chunks(deltas: list[ChoiceDelta]) -> list[object]:
            return [{**top, "choices": [_choice(d, call.logprobs, tokenizer)]} for d in deltas]

        def error(exc: ShardServeError) -> object:
            return error_object(exc)

        def last(_: object) -> list[object]:
            return [{**top, "choices": [], "usage": usage(run)}] if call.include_usage else []

        source = EventSource(chunks, error, last)
        return await request.until_disconnect(stream_events(request, run, source))
    choices = await collect(request, run)
    answer = {
        **top,
        "choices": [_choice(c, call.logprobs, tokenizer, i) for i, c in enumerate(choices)],
        "usage": usage(run),
    }
    return 200, orjson.dumps(answer), JSON, []


def _choice(
    part: ChoiceDelta | Collected, logprobs: bool, tokenizer: TextTokenizer, index: int = -1
) -> dict[str, Any]:
    return {
        "index": part.index if isinstance(part, ChoiceDelta) else index,
        "text": part.text,
        "finish_reason": part.finish_reason,
        "logprobs": _logprobs(part, tokenizer) if logprobs else None,
    }


def _logprobs(part: ChoiceDelta | Collected, tokenizer: TextTokenizer) -> dict[str, Any]:
    tokens = [tokenizer.decode([t]) for t in part.token_ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": part.logprobs,
        "top_logprobs": [{t: p} for t, p in zip(tokens, part.logprobs, strict=True)],
        "text_offset": offsets,
    }
