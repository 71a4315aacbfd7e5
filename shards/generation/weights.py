"""Per-stage weight files: the preset read once, each stage's layers written apart, so that a
stage actor builds and loads only its own blocks (and the embeddings or head it holds).

A stage file is an ``.npz`` of its layers' weights keyed ``<role>/<index>``, roles being
``token_embedding``, ``position_embedding`` (GPT-2), ``block_<j>`` (the stage's j-th block) and
``layer_norm``. A stage is built as a backbone of the preset's class with ``num_layers`` = its
block count (and a one-row vocabulary where it holds neither the embeddings nor the head), then
its roles' weights are set from the file. TensorFlow is imported by the callers' processes only
(a Ray task writes the files; the actors read them).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shards.generation.partition import StageCut
from shards.generation.preset import PresetSpec, read_preset

__all__ = [
    "build_stage_backbone",
    "head_files",
    "head_matrix",
    "load_whole_backbone",
    "stage_files",
    "stage_files_key",
    "write_stage_weights",
]

# Bumped when the file layout changes: older files are then written again, not misread.
FORMAT = 1


def _roles(
    backbone: Any,
    family: str,
    blocks: Sequence[int],
    first: bool,
    last: bool,
    head: bool = True,
) -> list:
    roles: list[tuple[str, Any]] = []
    if first or (last and head):
        # The head of both families is the token embedding's reverse (tied) or its own matrix
        # inside the same ReversibleEmbedding layer (untied).
        roles.append(("token_embedding", backbone.token_embedding))
    if first and family == "gpt2":
        roles.append(("position_embedding", backbone.position_embedding))
    roles += [(f"block_{j}", backbone.transformer_layers[i]) for j, i in enumerate(blocks)]
    if last:
        roles.append(("layer_norm", backbone.layer_norm))
    return roles


def stage_files_key(spec: PresetSpec, cuts: Sequence[StageCut], content: str) -> str:
    """The cache entry for ``cuts`` of the preset whose bytes hash to ``content``."""
    cut = ",".join(f"{c.first}-{c.last}" for c in cuts)
    digest = hashlib.sha256(f"{content};{cut};format={FORMAT}".encode()).hexdigest()
    return f"gen-{Path(spec.path).name[:40]}-{digest[:32]}"


def write_stage_weights(model_path: str, cuts: Sequence[StageCut], out: Path) -> list[str]:
    """Write ``out/stage-<i>.npz`` for each cut (reusing ``out`` when a complete copy is there);
    returns the files' paths. The directory appears whole or not at all."""
    files = [out / f"stage-{c.index}.npz" for c in cuts]
    if (out / "done.json").is_file() and all(f.is_file() for f in files):
        return [str(f) for f in files]
    spec = read_preset(model_path)
    backbone = load_whole_backbone(spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=out.parent))
    for cut in cuts:
        arrays: dict[str, np.ndarray] = {}
        roles = _roles(
            backbone,
            spec.family,
            range(cut.first, cut.last),
            cut.first == 0,
            cut.last == spec.num_layers,
        )
        for role, layer in roles:
            for i, w in enumerate(layer.get_weights()):
                arrays[f"{role}/{i}"] = w
        np.savez(tmp / f"stage-{cut.index}.npz", **arrays)  # type: ignore[arg-type]
    (tmp / "done.json").write_text(json.dumps({"cuts": [[c.first, c.last] for c in cuts]}))
    try:
        os.rename(tmp, out)
    except OSError:
        # Another writer finished first; its copy is as good as ours.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return [str(f) for f in files]


def load_whole_backbone(spec: PresetSpec) -> Any:
    """The preset's (or ``.keras`` file's) whole backbone, with its weights."""
    import keras
    import keras_hub  # noqa: F401  (registers the backbone classes)

    if spec.archive:
        return keras.saving.load_model(spec.path, compile=False).backbone
    # As Backbone.from_preset loads it, but from the config read_preset made complete (a tied
    # Llama's tie_word_embeddings, which keras_hub 0.32 does not save).
    backbone = keras.saving.deserialize_keras_object(dict(spec.backbone, config=spec.config))
    backbone.load_weights(str(Path(spec.path) / "model.weights.h5"))
    return backbone


def build_stage_backbone(
    spec: PresetSpec, first: int, last: int, weights_file: str, head: bool = True
) -> Any:
    """A backbone of the preset's class holding blocks ``[first, last)`` (as its blocks 0..),
    with its weights, and the embeddings/head where the stage holds them, from the stage file.
    ``head=False``: the last stage leaves the LM head to its head part actors (it holds the
    vocabulary only where it is also the first)."""
    import keras
    import keras_hub  # noqa: F401  (registers the backbone classes)

    holds_vocab = first == 0 or (last == spec.num_layers and head)
    config = dict(spec.config, num_layers=last - first)
    if not holds_vocab:
        config["vocabulary_size"] = 1
    backbone = keras.saving.deserialize_keras_object(dict(spec.backbone, config=config))
    with np.load(weights_file) as data:
        roles = _roles(
            backbone, spec.family, range(last - first), first == 0, last == spec.num_layers, head
        )
        for role, layer in roles:
            count = len(layer.weights)
            layer.set_weights([data[f"{role}/{i}"] for i in range(count)])
    return backbone


def stage_files(model_path: str, cuts: Sequence[StageCut], cache_dir: str) -> list[str]:
    """The stage files of ``cuts`` under ``cache_dir``, written on first use (keyed by the
    preset's bytes and the cut). Run in a Ray task: it loads TensorFlow."""
    from shards.actor.tflog import import_tensorflow
    from shards.bundle.cache import ensure_private
    from shards.bundle.fingerprint import model_sha256

    root = ensure_private(Path(cache_dir))
    spec = read_preset(model_path)
    key = stage_files_key(spec, cuts, model_sha256(Path(model_path), memo_dir=root))
    out = root / key
    if not ((out / "done.json").is_file()):
        import_tensorflow()  # its start-up lines held to the job's level (shards.actor.tflog)
    return write_stage_weights(model_path, cuts, out)


def head_matrix(backbone: Any) -> np.ndarray:
    """The LM head as ``[vocabulary, hidden]`` rows: the token embedding (tied) or the
    transposed ``reverse_embeddings`` (untied), both of the ReversibleEmbedding layer."""
    layer = backbone.token_embedding
    if getattr(layer, "logit_soft_cap", None) is not None:
        raise ValueError("a head with a logit soft cap is not split (Gemma-style): head_parts=1")
    if layer.tie_weights:
        return np.asarray(layer.embeddings.numpy())
    return np.asarray(layer.reverse_embeddings.numpy()).T


def head_files(model_path: str, parts: int, cache_dir: str) -> list[str]:
    """``head-<i>.npz`` under ``cache_dir``, one per part of the LM head split by vocabulary rows
    (``head_merge.slice_bounds``): ``kernel`` ``[rows, hidden]`` and ``offset``, written on first
    use (keyed by the preset's bytes and the part count), each written straight after it is
    sliced. Run in a Ray task: it loads TensorFlow."""
    from shards.actor.tflog import import_tensorflow
    from shards.bundle.cache import ensure_private
    from shards.bundle.fingerprint import model_sha256
    from shards.generation.head_merge import slice_bounds

    root = ensure_private(Path(cache_dir))
    spec = read_preset(model_path)
    content = model_sha256(Path(model_path), memo_dir=root)
    digest = hashlib.sha256(f"{content};head_parts={parts};format={FORMAT}".encode()).hexdigest()
    out = root / f"gen-head-{Path(spec.path).name[:40]}-{digest[:32]}"
    bounds = slice_bounds(spec.vocabulary_size, parts)
    files = [out / f"head-{i}.npz" for i in range(parts)]
    if (out / "done.json").is_file() and all(f.is_file() for f in files):
        return [str(f) for f in files]
    import_tensorflow()
    matrix = head_matrix(load_whole_backbone(spec))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=out.parent))
    for (start, stop), f in zip(bounds, files, strict=True):
        np.savez(tmp / f.name, kernel=matrix[start:stop], offset=np.int64(start))
    (tmp / "done.json").write_text(json.dumps({"bounds": bounds}))
    try:
        os.rename(tmp, out)
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return [str(f) for f in files]
