"""Request-level (static) batching with keras_hub's own ``generate``: the peer's model and the
model's ceiling (``python -m bench.systems.keras_generate --model PRESET --batch 8``).

A batch is padded to one shape, ``batch`` rows x ``length`` positions (rows missing copy the
first row), so that ``generate`` compiles once. Each row's prompt sits at its start; positions
past the row's own end (its prompt plus its ``max_tokens``) are marked given (``padding_mask``
True), so that ``generate`` keeps them. keras_hub's samplers stop at the padded length (or when
every row holds a stop id); ``UntilLongestRow`` stops once no row has a position left to
generate: the batch runs until its longest sequence ends, as a request-level batcher does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from bench import options

Row = tuple[Sequence[int], int]  # (prompt ids, max_tokens)


def pad_batch(rows: Sequence[Row], batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """``token_ids`` and ``padding_mask`` of shape ``[batch, length]`` for ``rows``; a row's
    mask is False exactly on the positions it generates."""
    if not 1 <= len(rows) <= batch:
        raise ValueError(f"a batch holds 1 to {batch} rows, got {len(rows)}")
    ids = np.zeros((batch, length), np.int32)
    mask = np.ones((batch, length), bool)
    for i in range(batch):
        prompt, max_tokens = rows[i] if i < len(rows) else rows[0]
        end = len(prompt) + max_tokens
        if not prompt or max_tokens < 1 or end > length:
            raise ValueError(
                f"row {i}: a prompt of {len(prompt)} ids and {max_tokens} new tokens do not fit "
                f"{length} positions"
            )
        ids[i, : len(prompt)] = prompt
        mask[i, len(prompt) : end] = False
    return ids, mask


def answers(token_ids: np.ndarray, rows: Sequence[Row]) -> list[list[int]]:
    """Each row's generated ids, cut from the padded batch."""
    out = []
    for i, (prompt, max_tokens) in enumerate(rows):
        out.append([int(t) for t in token_ids[i, len(prompt) : len(prompt) + max_tokens]])
    return out


def until_longest_row() -> Any:
    """keras_hub's greedy sampler, its loop started at the first position any row generates and
    stopped once none has a position left (keras_hub's own starts at the shortest prompt's
    length, reading the mask as a prefix, and runs to the padded length)."""
    from keras import ops
    from keras_hub.samplers import GreedySampler

    class UntilLongestRow(GreedySampler):  # type: ignore[misc]
        def __call__(
            self,
            next: Any,
            prompt: Any,
            cache: Any = None,
            index: Any = 0,
            mask: Any = None,
            stop_token_ids: Any = None,
            hidden_states: Any = None,
            model: Any = None,
            **kwargs: Any,
        ) -> Any:
            length = ops.shape(prompt)[-1]
            mask = ops.cast(mask, "bool")
            free = ops.logical_not(mask)
            positions = ops.arange(length, dtype="int32")[None, :]
            index = ops.cast(ops.min(ops.argmax(ops.cast(free, "int32"), axis=-1)), "int32")

            def cond(prompt: Any, cache: Any, index: Any, mask: Any) -> Any:
                return ops.any(ops.logical_and(free, positions >= index))

            def body(prompt: Any, cache: Any, index: Any, mask: Any) -> Any:
                logits, _, cache = next(prompt, cache, index)
                token = ops.cast(self.get_next_token(self.compute_probabilities(logits)), "int32")
                token = ops.where(mask[:, index], prompt[:, index], ops.cast(token, prompt.dtype))
                prompt = ops.slice_update(prompt, [0, index], token[:, None])
                return prompt, cache, index + 1, mask

            prompt, _, _, _ = self.run_loop(
                cond,
                body,
                loop_vars=(prompt, cache, index, mask),
                maximum_iterations=length - index,
                model=model,
            )
            return prompt

    return UntilLongestRow()


class StaticGenerator:
    """A preset's CausalLM generating padded batches of ``batch`` x ``length``."""

    def __init__(self, preset: str, batch: int, length: int) -> None:
        import keras_hub

        self.batch, self.length = batch, length
        self.lm = keras_hub.models.CausalLM.from_preset(preset)
        self.lm.preprocessor = None  # token ids in and out
        self.lm.compile(sampler=until_longest_row())

    def generate(self, rows: Sequence[Row]) -> list[list[int]]:
        ids, mask = pad_batch(rows, self.batch, self.length)
        out = self.lm.generate({"token_ids": ids, "padding_mask": mask}, stop_token_ids=None)
        return answers(np.asarray(out["token_ids"]), rows)


def ceiling(preset: str, batch: int, length: int, rows: Sequence[Row], seconds: float) -> Any:
    """Useful tokens per second of ``StaticGenerator`` alone, batches of ``rows`` in turn (after
    one compiling batch), for at least ``seconds`` and 3 batches."""
    generator = StaticGenerator(preset, batch, length)
    batches = [rows[i : i + batch] for i in range(0, len(rows) - batch + 1, batch)]
    generator.generate(batches[0])  # compiles
    times, tokens = [], 0
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end or n < 3:
        chosen = batches[n % len(batches)]
        tick = time.perf_counter()
        generator.generate(chosen)
        times.append(time.perf_counter() - tick)
        tokens += sum(m for _, m in chosen)
        n += 1
    return {
        "batch": batch,
        "batches": n,
        "tokens_per_s": tokens / sum(times),
        "batch_s_p50": statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.systems.keras_generate")
    opts = options.Options(parser)
    opts.add("model", required=True, help="a preset directory")
    opts.own("--batch", type=int, required=True)
    opts.own("--length", type=int, required=True, help="padded positions")
    opts.own("--rows", required=True, help="file: a JSON list of [prompt ids, max_tokens]")
    opts.add("seconds", default=20.0)
    args = parser.parse_args()
    with open(args.rows, "rb") as f:
        rows = [(p, m) for p, m in orjson.loads(f.read())]
    result = ceiling(args.model, args.batch, args.length, rows, args.seconds)
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
