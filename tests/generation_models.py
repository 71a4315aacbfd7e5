"""Tiny keras_hub causal LMs built in code (no download), saved as presets once per session.

Registered for every test folder by tests/conftest.py (``pytest_plugins``): request the
fixtures by name (``gpt2_preset``, ``llama_greedy``, ...) from any test.

- ``gpt2_preset``: a GPT-2 CausalLM with a byte-level BPE tokenizer from an in-code vocabulary
  and merges (``GPT2CausalLMPreprocessor``, ``add_start_token``), slot bound 32 positions.
- ``llama_preset``: a Llama CausalLM (4 query heads over 2 kv heads, RoPE, untied head) with a
  SentencePiece tokenizer trained in process (``llama_sentencepiece``; ``add_start_token``).
- ``gpt2_keras``: the GPT-2 CausalLM saved as a ``.keras`` file (it generates too).
- ``gpt2_greedy`` / ``llama_greedy``: ``CausalLM.generate`` (``sampler="greedy"``) on
  ``PROMPTS`` up to ``TOTAL_LENGTH`` tokens, computed once per session; the model seed is one
  whose greedy path is decisive (top-1 minus top-2 logit >= ``MARGIN`` at every generated step,
  asserted), so that a different but exact computation picks the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

__all__ = [
    "GPT2_MERGES",
    "GPT2_VOCABULARY",
    "MARGIN",
    "PROMPTS",
    "TOTAL_LENGTH",
    "Greedy",
    "gpt2_greedy",
    "gpt2_keras",
    "gpt2_preset",
    "llama_greedy",
    "llama_preset",
    "llama_sentencepiece",
]

# Prompts of different lengths (token ids valid in both models' vocabularies).
PROMPTS: tuple[tuple[int, ...], ...] = (
    (5, 6, 7),
    (8, 9, 10, 11, 12, 13, 14),
    (20,),
    (30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41),
    (50, 51, 52, 53, 54),
)
TOTAL_LENGTH = 24  # prompt + generated, as generate() pads to it
MARGIN = 1e-4


def _byte_vocabulary() -> tuple[dict[str, int], list[str]]:
    tokens = ["<|endoftext|>"]
    tokens += [chr(c) for c in range(33, 127)]  # printable ASCII maps to itself
    tokens += ["\u0120", "\u010a"]  # byte-level BPE's space and newline
    merges = ["\u0120 t", "h e", "\u0120t he", "i n", "e r", "\u0120 a", "o n", "\u0120 s"]
    for merge in merges:
        tokens.append(merge.replace(" ", ""))
    return {t: i for i, t in enumerate(tokens)}, merges


GPT2_VOCABULARY, GPT2_MERGES = _byte_vocabulary()
# A GPT-2 vocabulary of len(GPT2_VOCABULARY) (107) ids; the Llama model takes 128.
LLAMA_VOCABULARY_SIZE = 128


@dataclass(frozen=True)
class Greedy:
    preset: Path
    prompts: tuple[tuple[int, ...], ...]
    generated: tuple[tuple[int, ...], ...]  # each prompt's greedy continuation to TOTAL_LENGTH
    seed: int


def build_gpt2(path: Path, seed: int) -> None:
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=GPT2_VOCABULARY, merges=GPT2_MERGES)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer=tokenizer, sequence_length=TOTAL_LENGTH
    )
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=len(GPT2_VOCABULARY),
        num_layers=4,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=32,
    )
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)
    lm.save_to_preset(str(path))


# Sentences a tiny SentencePiece model is trained on, in process (no download).
_SPM_TEXT = (
    "the quick brown fox jumps over the lazy dog",
    "hello world, generating text token by token",
    "a sharded model serves its stages",
    "keys and values in the cache",
)


def llama_sentencepiece() -> bytes:
    """A 128-piece SentencePiece BPE model (pad 0, unk 1, <s> 2, </s> 3), trained in process."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_SPM_TEXT * 20),
        model_writer=model,
        vocab_size=LLAMA_VOCABULARY_SIZE,
        model_type="bpe",
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return model.getvalue()


def build_llama(path: Path, seed: int) -> None:
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    tokenizer = keras_hub.models.LlamaTokenizer(proto=llama_sentencepiece())
    assert tokenizer.vocabulary_size() == LLAMA_VOCABULARY_SIZE
    preprocessor = keras_hub.models.LlamaCausalLMPreprocessor(
        tokenizer=tokenizer, sequence_length=TOTAL_LENGTH
    )
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=LLAMA_VOCABULARY_SIZE,
        num_layers=4,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
    )
    lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=preprocessor)
    lm.save_to_preset(str(path))


def greedy_reference(
    preset: Path, prompts: Sequence[Sequence[int]], total: int
) -> tuple[list[tuple[int, ...]], float]:
    """keras_hub's own greedy generation of every prompt to ``total`` tokens (batched, one
    compile), and the smallest top-1 minus top-2 logit margin over the generated steps (from a
    whole forward pass over the result)."""
    import keras_hub

    lm = keras_hub.models.CausalLM.from_preset(str(preset), load_weights=True)
    return generate_greedy(lm, prompts, total)


def generate_greedy(
    lm: Any, prompts: Sequence[Sequence[int]], total: int
) -> tuple[list[tuple[int, ...]], float]:
    """``greedy_reference`` for a CausalLM in memory."""
    lm.preprocessor = None
    lm.compile(sampler="greedy")
    ids = np.zeros((len(prompts), total), np.int32)
    mask = np.zeros((len(prompts), total), bool)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
        mask[i, : len(p)] = True
    out = lm.generate({"token_ids": ids, "padding_mask": mask}, stop_token_ids=None)
    full = np.asarray(out["token_ids"])
    logits = np.asarray(lm({"token_ids": full, "padding_mask": np.ones_like(full)}))
    margin = float("inf")
    for i, p in enumerate(prompts):
        for position in range(len(p) - 1, total - 1):
            top = np.sort(logits[i, position])[-2:]
            margin = min(margin, float(top[1] - top[0]))
            # The reference must itself be the argmax of a whole pass.
            assert int(np.argmax(logits[i, position])) == int(full[i, position + 1])
    return [tuple(int(t) for t in full[i, len(p) :]) for i, p in enumerate(prompts)], margin


def _decisive(kind: str, root: Path) -> Greedy:
    build = build_gpt2 if kind == "gpt2" else build_llama
    margins = []
    for seed in range(8):
        path = root / f"{kind}-{seed}"
        build(path, seed)
        generated, margin = greedy_reference(path, PROMPTS, TOTAL_LENGTH)
        if margin >= MARGIN:
            return Greedy(path, PROMPTS, tuple(generated), seed)
        margins.append(margin)
    raise AssertionError(f"no {kind} seed in 0..7 has a decisive greedy path: margins {margins}")


@pytest.fixture(scope="session")
def gpt2_greedy(tmp_path_factory: pytest.TempPathFactory) -> Greedy:
    return _decisive("gpt2", tmp_path_factory.mktemp("gpt2-greedy"))


@pytest.fixture(scope="session")
def llama_greedy(tmp_path_factory: pytest.TempPathFactory) -> Greedy:
    return _decisive("llama", tmp_path_factory.mktemp("llama-greedy"))


@pytest.fixture(scope="session")
def gpt2_preset(gpt2_greedy: Greedy) -> Path:
    return gpt2_greedy.preset


@pytest.fixture(scope="session")
def gpt2_keras(gpt2_preset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GPT-2 preset's CausalLM saved as one ``.keras`` file (tokenizer assets inside)."""
    import keras_hub

    path = tmp_path_factory.mktemp("gpt2-keras") / "gpt2.keras"
    keras_hub.models.CausalLM.from_preset(str(gpt2_preset)).save(str(path))
    return path


@pytest.fixture(scope="session")
def llama_preset(llama_greedy: Greedy) -> Path:
    return llama_greedy.preset
