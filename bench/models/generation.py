"""The generation bench's model and load (issue 39): a GPT-2-shaped causal LM built in code and
saved with ``save_to_preset`` (no download), and the seeded requests sent to it.

The model is random: what it generates means nothing, only its cost does. Stop ids are off in
every request, so each answer is exactly its ``max_tokens`` long and every system computes the
same useful tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

# A byte-level BPE vocabulary small enough to build in code (the tests' GPT-2 has the same
# shape): printable ASCII, the space and newline bytes, a few merges.
_MERGES = ["\u0120 t", "h e", "\u0120t he", "i n", "e r", "\u0120 a", "o n", "\u0120 s"]


def vocabulary() -> tuple[dict[str, int], list[str]]:
    tokens = ["<|endoftext|>", *(chr(c) for c in range(33, 127)), "\u0120", "\u010a"]
    tokens += [merge.replace(" ", "") for merge in _MERGES]
    return {t: i for i, t in enumerate(tokens)}, list(_MERGES)


VOCABULARY_SIZE = len(vocabulary()[0])


@dataclass(frozen=True)
class ModelShape:
    blocks: int = 12
    hidden: int = 512
    max_length: int = 192  # prompt and generated tokens together: the slot / padded length

    @property
    def heads(self) -> int:
        return max(1, self.hidden // 64)

    def describe(self) -> str:
        return (
            f"GPT-2 shape, {self.blocks} blocks x {self.hidden} wide ({self.heads} heads, "
            f"MLP {4 * self.hidden}), vocabulary {VOCABULARY_SIZE}, {self.max_length} positions"
        )


def save_preset(shape: ModelShape, workdir: Path, seed: int = 0) -> Path:
    """The model saved as a keras_hub preset directory (once per shape; reused after)."""
    path = workdir / f"gpt2-{shape.blocks}x{shape.hidden}-{shape.max_length}"
    if (path / "metadata.json").exists():
        return path
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    vocab, merges = vocabulary()
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocab, merges=merges)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer=tokenizer, sequence_length=shape.max_length
    )
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY_SIZE,
        num_layers=shape.blocks,
        num_heads=shape.heads,
        hidden_dim=shape.hidden,
        intermediate_dim=4 * shape.hidden,
        max_sequence_length=shape.max_length,
    )
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)
    path.parent.mkdir(parents=True, exist_ok=True)
    lm.save_to_preset(str(path))
    return path


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    max_tokens: int


def prompts(
    n: int,
    seed: int,
    *,
    lengths: tuple[int, int] = (16, 64),
    max_tokens: tuple[int, int] = (8, 128),
) -> list[Prompt]:
    """``n`` prompts, seeded: lengths and ``max_tokens`` uniform in their ranges (both ends
    included), ids drawn from the vocabulary past id 0 (the end token, though no stop id is on)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(lengths[0], lengths[1] + 1))
        ids = tuple(int(i) for i in rng.integers(1, VOCABULARY_SIZE, length))
        out.append(Prompt(ids, int(rng.integers(max_tokens[0], max_tokens[1] + 1))))
    return out


def body(prompt: Prompt) -> bytes:
    """A generate request (the server's route and the peer take the same body): token ids in,
    greedy, stop ids off so that the answer is ``max_tokens`` long."""
    parameters = {"max_tokens": prompt.max_tokens, "temperature": 0, "stop_token_ids": []}
    return orjson.dumps({"input_ids": list(prompt.ids), "parameters": parameters})
