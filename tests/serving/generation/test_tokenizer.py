"""The front end's tokenizer against keras_hub's own, on the tiny GPT-2 preset's in-code
vocabulary and merges (tests/generation_models.py). keras_hub is imported by the test only:
``serving`` never imports it."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.generation.tokenizer import ByteBPETokenizer, load_tokenizer
from tests.generation_fakes import make_info
from tests.generation_models import GPT2_MERGES, GPT2_VOCABULARY

TEXTS = [
    "the cat sat on the mat",
    "Hello, world!",
    "  two  spaces and a trailing one ",
    "line one\nline two\n\nend",
    "ids 12345 and 3.14, (a+b)=c; 'quoted' don't",
    "before<|endoftext|>after",
    "",
]


@pytest.fixture(scope="module")
def keras_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    keras_hub = pytest.importorskip("keras_hub")
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=GPT2_VOCABULARY, merges=GPT2_MERGES)
    directory = tmp_path_factory.mktemp("gpt2-tokenizer")
    tokenizer.save_assets(str(directory))
    return tokenizer, directory


def test_byte_bpe_equals_keras_hubs_gpt2_tokenizer(keras_tokenizer: tuple[object, Path]) -> None:
    tokenizer, directory = keras_tokenizer
    ours = ByteBPETokenizer(directory)
    for text in TEXTS:
        theirs = [int(t) for t in tokenizer.tokenize(text)]  # type: ignore[attr-defined]
        assert ours.encode(text) == theirs, text
        assert ours.decode(theirs) == tokenizer.detokenize(theirs), text  # type: ignore[attr-defined]
    assert ours.encode("the")[:1] != [GPT2_VOCABULARY["<|endoftext|>"]]


def test_the_start_token_is_added_as_the_preprocessor_does(
    keras_tokenizer: tuple[object, Path],
) -> None:
    import keras_hub

    tokenizer, directory = keras_tokenizer
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer=tokenizer, sequence_length=16
    )
    packed = preprocessor.generate_preprocess(["the cat sat"])
    ids = [
        int(t)
        for t, keep in zip(packed["token_ids"][0], packed["padding_mask"][0], strict=True)
        if keep
    ]
    start = GPT2_VOCABULARY["<|endoftext|>"]
    ours = ByteBPETokenizer(directory, start_token_id=start)
    assert ours.encode("the cat sat") == ids
    assert ids[0] == start


def test_a_model_without_a_tokenizer_serves_ids_only(tmp_path: Path) -> None:
    assert load_tokenizer(make_info()) is None


def test_the_longest_token_bounds_the_bytes_a_slot_holds(
    keras_tokenizer: tuple[object, Path],
) -> None:
    _, directory = keras_tokenizer
    # "<|endoftext|>" is the longest token: 13 bytes of text.
    assert ByteBPETokenizer(directory).max_token_bytes == 13


CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stage holds its decoder blocks and a cache of keys and values",
    "tokens are generated one step at a time, each at its own position",
    "Numbers 12345 and punctuation: (a+b)=c; don't stop!",
]


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import io

    sentencepiece = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4),
        model_writer=model,
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
    )
    directory = tmp_path_factory.mktemp("spm")
    (directory / "vocabulary.spm").write_bytes(model.getvalue())
    return directory


def test_sentencepiece_equals_keras_hubs_llama_tokenizer(spm_dir: Path) -> None:
    keras_hub = pytest.importorskip("keras_hub")
    from serving.generation.tokenizer import SentencePieceTokenizer

    proto = (spm_dir / "vocabulary.spm").read_bytes()
    theirs = keras_hub.models.LlamaTokenizer(proto=proto)
    ours = SentencePieceTokenizer(spm_dir)
    for text in [*CORPUS, "unseen words: zebra quux, and é ü", "  spaces  twice ", ""]:
        ids = [int(t) for t in theirs.tokenize(text)]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.detokenize(ids), text
    start = theirs.start_token_id
    assert SentencePieceTokenizer(spm_dir, start).encode("the fox")[0] == start
