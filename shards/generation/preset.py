"""Reading a keras_hub CausalLM preset directory (or ``.keras`` file) without TensorFlow.

A preset (``CausalLM.save_to_preset(dir)``) holds ``metadata.json``, the backbone's
``config.json``, the task's ``task.json``, ``model.weights.h5`` and the tokenizer's assets under
``assets/tokenizer/``. A ``.keras`` file of a CausalLM (``lm.save(path)``) is a zip holding the
task's ``config.json`` (the backbone and preprocessor inside it), ``model.weights.h5`` and the
tokenizer's assets under ``assets/preprocessor/tokenizer/``. Everything here reads JSON only, so
the front end can ask whether a path generates (``is_generating_model``) and what its tokenizer
is without importing TensorFlow.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shards.errors import ResolveError

__all__ = [
    "ARCHIVE_TOKENIZER",
    "DEFAULT_MAX_LENGTH",
    "FAMILIES",
    "PresetSpec",
    "extract_tokenizer",
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

# Where a .keras file of a CausalLM keeps its tokenizer's assets.
ARCHIVE_TOKENIZER = "assets/preprocessor/tokenizer/"


@dataclass(frozen=True)
class PresetSpec:
    """What a preset directory says about its model, read from its JSON files."""

    path: str
    family: str
    backbone_class: str
    config: dict[str, Any]  # the backbone's config (config.json's "config")
    backbone: dict[str, Any]  # the backbone serialized (module, class_name, config, ...)
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
    archive: bool = False  # a .keras file, not a preset directory

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


def _archive_task(path: Path) -> dict[str, Any] | None:
    """The task config of a ``.keras`` file holding a keras_hub CausalLM, else None."""
    if not (path.is_file() and path.suffix == ".keras" and zipfile.is_zipfile(path)):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None
    if not isinstance(config, dict) or not str(config.get("class_name", "")).endswith("CausalLM"):
        return None
    task = config.get("config")
    if not isinstance(task, dict) or not isinstance(task.get("backbone"), dict):
        return None
    return task


def _sources(path: Path) -> tuple[dict[str, Any], Any] | None:
    """(the backbone's serialized config, the preprocessor's) of a CausalLM preset directory or
    ``.keras`` file; None when ``path`` is neither."""
    task = _archive_task(path)
    if task is not None:
        return task["backbone"], task.get("preprocessor")
    if not is_preset_dir(path):
        return None
    try:
        metadata = _read_json(path / "metadata.json")
        backbone = _read_json(path / "config.json")
        task_file = _read_json(path / "task.json")
    except (OSError, ValueError):
        return None
    if not isinstance(metadata, dict) or "CausalLM" not in (metadata.get("tasks") or []):
        return None
    if not isinstance(backbone, dict):
        return None
    task_config = (task_file.get("config") or {}) if isinstance(task_file, dict) else {}
    return backbone, task_config.get("preprocessor")


def is_generating_model(path: str) -> bool:
    """True when ``path`` is a keras_hub CausalLM of a supported family: a preset directory or a
    ``.keras`` file (which also keeps serving ``:predict``)."""
    sources = _sources(Path(path))
    return sources is not None and sources[0].get("class_name") in FAMILIES


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
    """Read a CausalLM preset's (or ``.keras`` file's) JSON; an unsupported family is refused by
    name."""
    p = Path(path)
    sources = _sources(p)
    if sources is None:
        if is_preset_dir(p):
            raise ResolveError(f"{path!r}: metadata.json does not name a CausalLM task")
        raise ResolveError(
            f"{path!r} is neither a keras_hub preset directory (metadata.json, config.json, "
            "task.json) nor a .keras file of a keras_hub CausalLM"
        )
    backbone, preprocessor = sources
    backbone_class = str(backbone.get("class_name"))
    family = FAMILIES.get(backbone_class)
    if family is None:
        supported = ", ".join(sorted(FAMILIES))
        raise ResolveError(
            f"{path!r}: backbone {backbone_class!r} cannot generate here; supported: {supported}"
        )
    config = dict(backbone["config"])
    if family == "llama" and not p.is_file() and _tied_in_weights(p / "model.weights.h5"):
        # keras_hub 0.32's LlamaBackbone.get_config leaves tie_word_embeddings out, so a tied
        # preset does not load in keras_hub itself; its weights file says it is tied.
        config["tie_word_embeddings"] = True
    hidden = int(config["hidden_dim"])
    if family == "gpt2":
        heads = int(config["num_heads"])
        kv_heads = heads
        bound: int | None = int(config["max_sequence_length"])
    else:
        heads = int(config["num_query_heads"])
        kv_heads = int(config["num_key_value_heads"])
        bound = None
    archive = p.is_file()
    tokenizer_dir = p / "assets" / "tokenizer"
    has_tokenizer = isinstance(preprocessor, dict) and (
        _archive_has(p, ARCHIVE_TOKENIZER) if archive else tokenizer_dir.is_dir()
    )
    add_start = has_tokenizer and bool(
        (preprocessor.get("config") or {}).get("add_start_token", True)  # type: ignore[union-attr]
    )
    return PresetSpec(
        path=str(p),
        family=family,
        backbone_class=backbone_class,
        config=config,
        backbone=backbone,
        num_layers=int(config["num_layers"]),
        hidden_dim=hidden,
        vocabulary_size=int(config["vocabulary_size"]),
        kv_heads=kv_heads,
        head_dim=hidden // heads,
        max_length_bound=bound,
        dtype_bytes=_dtype_bytes(config),
        # A .keras file's tokenizer is inside it: extract_tokenizer() puts it on disk.
        tokenizer_dir=str(tokenizer_dir) if has_tokenizer and not archive else None,
        tokenizer_kind=_TOKENIZER_KINDS[family] if has_tokenizer else None,
        add_start_token=add_start,
        archive=archive,
    )


def _tied_in_weights(weights: Path) -> bool:
    """Whether a preset's weights hold one token embedding matrix (a tied head) and not two."""
    import h5py

    try:
        with h5py.File(weights, "r") as f:
            held = f.get("layers/reversible_embedding/vars")
            return held is not None and len(held) == 1
    except OSError:
        return False


def _archive_has(path: Path, prefix: str) -> bool:
    with zipfile.ZipFile(path) as archive:
        return any(name.startswith(prefix) for name in archive.namelist())


def extract_tokenizer(spec: PresetSpec, dest: Path) -> PresetSpec:
    """A ``.keras`` file's spec with its tokenizer's assets extracted under ``dest`` (no
    TensorFlow: a zip read), so the front end reads them as it reads a preset's."""
    if not spec.archive or spec.tokenizer_kind is None:
        return spec
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(spec.path) as archive:
        for name in archive.namelist():
            if name.startswith(ARCHIVE_TOKENIZER) and not name.endswith("/"):
                target = dest / Path(name).name
                target.write_bytes(archive.read(name))
    return replace(spec, tokenizer_dir=str(dest))


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
