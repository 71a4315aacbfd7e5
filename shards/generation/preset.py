"""Reading a keras_hub CausalLM preset directory without TensorFlow.

A preset (``CausalLM.save_to_preset(dir)``) holds ``metadata.json``, the backbone's
``config.json``, the task's ``task.json``, ``model.weights.h5`` and the tokenizer's assets under
``assets/tokenizer/``. Everything here reads JSON only, so the front end can ask whether a path
generates (``is_generating_model``) and what its tokenizer is without importing TensorFlow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shards.errors import ResolveError

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "FAMILIES",
    "PresetSpec",
    "is_generating_model",
    "is_preset_dir",
    "read_preset",
    "special_tokens",
]

# The backbone class a preset names -> the family whose stage body runs it.
FAMILIES: dict[str, str] = {"GPT2Backbone": "gpt2", "LlamaBackbone": "llama"}

# The slot length for a family with no position bound of its own (RoPE): issue 39 says 2,048.
DEFAULT_MAX_LENGTH = 2048

_TOKENIZER_KINDS = {"gpt2": "byte_bpe", "llama": "sentencepiece"}


@dataclass(frozen=True)
class PresetSpec:
    """What a preset directory says about its model, read from its JSON files."""

    path: str
    family: str
    backbone_class: str
    config: dict[str, Any]  # the backbone's config (config.json's "config")
    num_layers: int
    hidden_dim: int
    vocabulary_size: int
    kv_heads: int
    head_dim: int
    max_length_bound: int | None  # the model's own bound on positions (GPT-2's rows); None: none
    dtype_bytes: int
    tokenizer_dir: str | None
    tokenizer_kind: str | None
    add_start_token: bool  # the preset's preprocessor prepends the start token

    @property
    def default_max_length(self) -> int:
        return self.max_length_bound if self.max_length_bound is not None else DEFAULT_MAX_LENGTH


def _read_json(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def is_preset_dir(path: Path) -> bool:
    """A keras_hub preset directory (of any task or family)."""
    return (
        path.is_dir()
        and (path / "metadata.json").is_file()
        and (path / "config.json").is_file()
        and (path / "task.json").is_file()
    )


def _backbone_class(path: Path) -> str | None:
    try:
        metadata = _read_json(path / "metadata.json")
        config = _read_json(path / "config.json")
    except (OSError, ValueError):
        return None
    if not isinstance(metadata, dict) or "CausalLM" not in (metadata.get("tasks") or []):
        return None
    if not isinstance(config, dict):
        return None
    name = config.get("class_name")
    return name if isinstance(name, str) else None


def is_generating_model(path: str) -> bool:
    """True when ``path`` is a keras_hub CausalLM preset directory of a supported family."""
    p = Path(path)
    if not is_preset_dir(p):
        return False
    return _backbone_class(p) in FAMILIES


def _dtype_bytes(config: dict[str, Any]) -> int:
    dtype = config.get("dtype")
    name = "float32"
    if isinstance(dtype, dict):
        name = str((dtype.get("config") or {}).get("name", "float32"))
    elif isinstance(dtype, str):
        name = dtype
    # A mixed policy ("mixed_bfloat16") computes, and so caches, in its second half.
    name = name.split("_")[-1]
    return {"float16": 2, "bfloat16": 2, "float64": 8}.get(name, 4)


def read_preset(path: str) -> PresetSpec:
    """Read a preset's JSON; a CausalLM of an unsupported family is refused by name."""
    p = Path(path)
    if not is_preset_dir(p):
        raise ResolveError(
            f"{path!r} is not a keras_hub preset directory (metadata.json, config.json, task.json)"
        )
    backbone_class = _backbone_class(p)
    if backbone_class is None:
        raise ResolveError(f"{path!r}: metadata.json does not name a CausalLM task")
    family = FAMILIES.get(backbone_class)
    if family is None:
        supported = ", ".join(sorted(FAMILIES))
        raise ResolveError(
            f"{path!r}: backbone {backbone_class!r} cannot generate here; supported: {supported}"
        )
    config = dict(_read_json(p / "config.json")["config"])
    hidden = int(config["hidden_dim"])
    if family == "gpt2":
        heads = int(config["num_heads"])
        kv_heads = heads
        bound: int | None = int(config["max_sequence_length"])
    else:
        heads = int(config["num_query_heads"])
        kv_heads = int(config["num_key_value_heads"])
        bound = None
    task = _read_json(p / "task.json")
    task_config = (task.get("config") or {}) if isinstance(task, dict) else {}
    preprocessor = task_config.get("preprocessor")
    tokenizer_dir = p / "assets" / "tokenizer"
    has_tokenizer = isinstance(preprocessor, dict) and tokenizer_dir.is_dir()
    add_start = has_tokenizer and bool(
        (preprocessor.get("config") or {}).get("add_start_token", True)  # type: ignore[union-attr]
    )
    return PresetSpec(
        path=str(p),
        family=family,
        backbone_class=backbone_class,
        config=config,
        num_layers=int(config["num_layers"]),
        hidden_dim=hidden,
        vocabulary_size=int(config["vocabulary_size"]),
        kv_heads=kv_heads,
        head_dim=hidden // heads,
        max_length_bound=bound,
        dtype_bytes=_dtype_bytes(config),
        tokenizer_dir=str(tokenizer_dir) if has_tokenizer else None,
        tokenizer_kind=_TOKENIZER_KINDS[family] if has_tokenizer else None,
        add_start_token=add_start,
    )


def special_tokens(spec: PresetSpec) -> tuple[tuple[int, ...], int | None]:
    """The preset's end token ids and start token id, read from its tokenizer assets (no
    TensorFlow); ``((), None)`` for a preset without a tokenizer."""
    if spec.tokenizer_dir is None:
        return (), None
    assets = Path(spec.tokenizer_dir)
    if spec.family == "gpt2":
        vocabulary = _read_json(assets / "vocabulary.json")
        token = vocabulary.get("<|endoftext|>")
        if token is None:
            return (), None
        # GPT-2's start token is also its end token.
        return (int(token),), int(token)
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=str(assets / "vocabulary.spm"))
    end = processor.piece_to_id("</s>")
    start = processor.piece_to_id("<s>")
    unknown = processor.unk_id()
    return ((int(end),) if end != unknown else ()), (int(start) if start != unknown else None)
