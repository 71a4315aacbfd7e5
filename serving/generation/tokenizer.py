"""The tokenizer of a generating model, in the front end: no TensorFlow.

A keras_hub preset holds its tokenizer's assets (``GenerationInfo.tokenizer_dir``). GPT-2's
byte-level BPE (``vocabulary.json`` + ``merges.txt``) is read by the ``tokenizers`` library with
GPT-2's pre-tokenizer, the special tokens kept whole as keras_hub's ``unsplittable_tokens``
(tests/serving/generation/test_tokenizer.py holds it equal to keras_hub's ``GPT2Tokenizer``).
Llama's SentencePiece model (``vocabulary.spm``) is read by the ``sentencepiece`` library
(held equal to keras_hub's ``LlamaTokenizer`` there too). A model without a tokenizer (a preset
saved with ``preprocessor=None``) serves token ids only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from shards.generation.contract import GenerationInfo

__all__ = ["ByteBPETokenizer", "SentencePieceTokenizer", "TextTokenizer", "load_tokenizer"]

VOCAB_FILENAME = "vocabulary.json"
MERGES_FILENAME = "merges.txt"
SPM_FILENAME = "vocabulary.spm"


class TextTokenizer(Protocol):
    # The most UTF-8 bytes one token stands for: a slot of n positions holds at most n times
    # this many bytes of text, so a longer text is refused before it is tokenized.
    max_token_bytes: int

    def encode(self, text: str) -> list[int]:
        """The prompt's ids as the preset's preprocessor makes them for ``generate`` (its
        start token first where it adds one)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteBPETokenizer:
    """GPT-2's byte-level BPE from a preset's ``vocabulary.json`` and ``merges.txt``."""

    def __init__(self, directory: str | Path, start_token_id: int | None = None) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        directory = Path(directory)
        vocabulary: dict[str, int] = json.loads(
            (directory / VOCAB_FILENAME).read_text(encoding="utf-8")
        )
        merges = [
            tuple(line.split(" "))
            for line in (directory / MERGES_FILENAME).read_text(encoding="utf-8").splitlines()
            if line and not line.startswith("#version")
        ]
        tokenizer = Tokenizer(models.BPE(vocabulary, merges))  # type: ignore[arg-type]
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        # keras_hub keeps its special tokens (GPT-2's "<|endoftext|>") whole in a text.
        specials = [t for t in vocabulary if t.startswith("<|") and t.endswith("|>")]
        tokenizer.add_special_tokens([AddedToken(t, normalized=False) for t in specials])
        self._tokenizer = tokenizer
        self._start = start_token_id
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        self.max_token_bytes = max(
            (sum(1 for c in token if c in byte_of) for token in vocabulary), default=1
        )
        self.max_token_bytes = max(self.max_token_bytes, *(len(t.encode()) for t in specials), 1)

    def encode(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids if self._start is None else [self._start, *ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


class SentencePieceTokenizer:
    """Llama's SentencePiece model from a preset's ``vocabulary.spm`` (the ``sentencepiece``
    library, as keras_hub's ``SentencePieceTokenizer`` reads it through tensorflow_text)."""

    def __init__(self, directory: str | Path, start_token_id: int | None = None) -> None:
        import sentencepiece

        path = Path(directory) / SPM_FILENAME
        self._model = sentencepiece.SentencePieceProcessor(model_proto=path.read_bytes())
        self._start = start_token_id
        model = self._model
        plain = (
            model.id_to_piece(i)
            for i in range(model.get_piece_size())
            if not (model.is_control(i) or model.is_byte(i) or model.is_unknown(i))
        )
        # "\u2581" stands for one space; a byte-fallback piece for one byte; an unknown
        # character is one piece of up to 4 bytes.
        self.max_token_bytes = max(
            (len(p.replace("\u2581", " ").encode()) for p in plain), default=1
        )
        self.max_token_bytes = max(self.max_token_bytes, 4)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._model.encode(text)
        return ids if self._start is None else [self._start, *ids]

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._model.decode(list(ids))
        return text


def load_tokenizer(info: GenerationInfo) -> TextTokenizer | None:
    """The model's tokenizer, or ``None`` where it has none (token ids only). A kind this
    front end cannot read is refused by name."""
    if info.tokenizer_dir is None or info.tokenizer_kind is None:
        return None
    if info.tokenizer_kind == "byte_bpe":
        return ByteBPETokenizer(info.tokenizer_dir, info.start_token_id)
    if info.tokenizer_kind == "sentencepiece":
        return SentencePieceTokenizer(info.tokenizer_dir, info.start_token_id)
    raise ValueError(
        f"tokenizer kind {info.tokenizer_kind!r} of a {info.model_family} model is not served "
        "in the front end (byte_bpe and sentencepiece are)"
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of each byte to the printable character that stands for it in the vocabulary."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}
