"""Turn what the user named as ``--model`` into a bundle directory, partitioning on the fly.

Accepted: a bundle directory, a ``.keras`` file, a TF SavedModel directory, or a demo model name.
Partitioned bundles are cached under ``cache_dir`` (shards.bundle.cache), keyed by everything
the bundle depends on: every byte of the model's files, the options, the bundle format, the
partitioner's own source and the Keras and TensorFlow versions (shards.bundle.fingerprint). A
bundle is written to a temporary directory that is renamed into place, so a crash or a
concurrent resolver never leaves a half-written bundle where a later call would reuse it; the
cache is then pruned to ``cache_max_bytes``.

TensorFlow is imported only when a model must be partitioned (inside the function), so importing
this module is cheap; callers run it in a Ray task to keep TensorFlow out of the HTTP process.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shards.bundle import cache
from shards.bundle.fingerprint import built_with, model_sha256
from shards.bundle.format import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    BundleError,
    Manifest,
    allowed_imports,
    read_manifest,
)
from shards.errors import ResolveError
from shards.generation.preset import is_preset_dir, read_preset
from shards.partition.memory_plan import parse_budgets
from shards.split import DEFAULT_LOOKUP_COMBINE, check_lookup_combine

if TYPE_CHECKING:
    import keras


DEMO_NAMES = ("demo-tiny", "demo-mlp", "demo-resnet", "demo-tokens", "demo-tagger", "demo-conv1d")
ACCEPTED = (
    "a bundle directory (with manifest.json), a .keras file, a TF SavedModel directory (with "
    f"saved_model.pb), or a demo model name ({', '.join(DEMO_NAMES)})"
)


@dataclass(frozen=True, kw_only=True)
class ResolveOptions:
    """What a bundle is cut with and cached under, as ``resolve_bundle`` and
    ``shards.source.remote.resolve_bundle_remote`` take it (picklable, for the Ray task).

    ``plan_batch_rows``, ``device_overhead_bytes`` and ``max_sequence_length`` (what an unknown
    dimension counts as; ``None``: the model's own bound, else 512) size the memory plan
    (shards.partition.memory_plan); a length over the model's bound is refused;
    ``unsafe_deserialization`` lets a ``.keras`` file with Lambda layers load;
    ``lookup_combine``: how a table split by rows is joined (``shards.split.lookup``)."""

    stages: int | None
    max_stage_bytes: int | Sequence[int] | None
    imports: Sequence[str] = ()
    cache_dir: Path
    plan_batch_rows: int = 32
    device_overhead_bytes: int | None = None
    unsafe_deserialization: bool = False
    weight_dtype: str | None = None
    cache_max_bytes: int = cache.DEFAULT_MAX_BYTES
    max_sequence_length: int | None = None
    lookup_combine: str = DEFAULT_LOOKUP_COMBINE

    def __post_init__(self) -> None:
        check_lookup_combine(self.lookup_combine)
        budgets = self.max_stage_bytes
        if budgets is not None and not isinstance(budgets, int):
            object.__setattr__(self, "max_stage_bytes", tuple(budgets))
        object.__setattr__(self, "imports", tuple(self.imports))
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))


def resolve_bundle(
    model: str, options: ResolveOptions, *, progress: Callable[[str], None] | None = None
) -> Path:
    """The bundle directory ``model`` names, or the cached bundle cut from it with ``options``.
    The caller marks the bundle it serves (``shards.bundle.cache.hold``), or a later prune may
    remove it."""
    path = Path(model).expanduser()
    budgets = None if options.max_stage_bytes is None else parse_budgets(options.max_stage_bytes)
    if (path / MANIFEST_NAME).is_file():
        manifest = read_manifest(path)
        _check_bundle_options(path, manifest, options.stages, budgets)
        _check_length(path, manifest, options.max_sequence_length)
        allowed_imports(
            manifest, options.imports, unsafe_deserialization=options.unsafe_deserialization
        )
        return path
    cache_dir = cache.ensure_private(options.cache_dir)
    keyed = f"stages={options.stages};max_stage_bytes={budgets};imports={list(options.imports)}"
    keyed += f";batch={options.plan_batch_rows};overhead={options.device_overhead_bytes}"
    keyed += f";length={options.max_sequence_length};lookup={options.lookup_combine}"
    if options.weight_dtype not in (None, "float32"):
        keyed += f";weights={options.weight_dtype}"
    key = cache_key(model, path, keyed, cache_dir)
    final = cache_dir / key
    if _is_bundle(final):
        cache.touch(final)
    else:
        with cache.writing(cache_dir, key) as tmp:
            _partition(model, path, tmp, options, budgets, progress)
            try:
                os.rename(tmp, final)
            except OSError:
                # Another resolver finished the same bundle first; its copy is as good as ours.
                if not _is_bundle(final):
                    raise
    cache.prune(cache_dir, options.cache_max_bytes, keep=[key])
    return final


def cache_key(model: str, path: Path, options: str, cache_dir: Path) -> str:
    """``<name>-<digest>``: the digest covers the model's bytes (every file of a SavedModel,
    ``variables/`` and assets included), the options, the bundle format and the code that cuts
    (partitioner source, Keras and TensorFlow versions)."""
    if (path.is_dir() and (path / "saved_model.pb").is_file()) or (
        path.is_file() and path.suffix == ".keras"
    ):
        name, content = path.name, model_sha256(path, memo_dir=cache_dir)
    elif model in DEMO_NAMES:
        name, content = model, "demo"  # built in code: models.py is in the partitioner digest
    elif is_preset_dir(path):
        # A keras_hub preset is not cut into a bundle: read_preset refuses a family that cannot
        # generate by name, and one that can is served by shards.generation.
        spec = read_preset(str(path))
        raise ResolveError(
            f"{model!r} is a keras_hub {spec.backbone_class} preset: it is served by generation "
            "(shards.generation), not as a bundle"
        )
    elif path.exists():
        raise ResolveError(f"cannot serve {model!r}: expected {ACCEPTED}")
    else:
        raise ResolveError(f"{model!r} does not exist and is not a demo model; expected {ACCEPTED}")
    code = ";".join(f"{k}={v}" for k, v in sorted(built_with().items()))
    digest = _sha256(f"{content};{options};format={FORMAT_VERSION};{code}")
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', name)[:40]}-{digest[:32]}"


def _partition(
    model: str,
    path: Path,
    out: Path,
    options: ResolveOptions,
    budgets: tuple[int, ...] | None,
    progress: Callable[[str], None] | None,
) -> Manifest:
    from shards.actor.tflog import import_tensorflow

    import_tensorflow()  # before the partitioner loads it: its start-up lines held (tflog)
    from shards.partition.cut import partition_to_bundle

    if path.exists():
        source: Path | keras.Model = path
        name = None
    else:
        from shards.partition.demo_models import build_demo

        source, name = build_demo(model), f"demo:{model}"
    return partition_to_bundle(
        source,
        out,
        stages=options.stages,
        max_stage_bytes=budgets,
        imports=options.imports,
        source_name=name,
        progress=progress,
        plan_batch_rows=options.plan_batch_rows,
        device_overhead_bytes=options.device_overhead_bytes,
        weight_dtype=options.weight_dtype,
        max_sequence_length=options.max_sequence_length,
        unsafe_deserialization=options.unsafe_deserialization,
        lookup_combine=options.lookup_combine,
    )


def _check_length(path: Path, manifest: Manifest, requested: int | None) -> None:
    bound = manifest.signature.max_length
    if requested is not None and bound is not None and requested > bound:
        raise ResolveError(
            f"max_sequence_length={requested} is over {bound}, the longest input the model of "
            f"bundle {str(path)!r} takes; serve it with --max-sequence-length at most {bound}, "
            f"or leave the flag out to serve up to {bound}"
        )


def _check_bundle_options(
    path: Path, manifest: Manifest, stages: int | None, budgets: tuple[int, ...] | None
) -> None:
    if stages is not None and stages != len(manifest.stages):
        raise ResolveError(
            f"bundle {str(path)!r} has {len(manifest.stages)} stages but stages={stages} was "
            "asked; drop the option or re-partition the source model"
        )
    if budgets is None:
        return
    if len(budgets) > 1 and len(budgets) != len(manifest.stages):
        raise ResolveError(
            f"bundle {str(path)!r} has {len(manifest.stages)} stages but max_stage_bytes lists "
            f"{len(budgets)} device budgets; give one per stage or re-partition the source model"
        )
    for spec in manifest.stages:
        budget = budgets[spec.index] if len(budgets) > 1 else budgets[0]
        if spec.planned_peak_bytes > budget:
            raise ResolveError(
                f"bundle {str(path)!r} stage {spec.index} needs {spec.planned_peak_bytes} bytes "
                f"at its peak ({spec.param_bytes} of weights), over max_stage_bytes={budget}; "
                "re-partition the source model with this budget"
            )


def _is_bundle(path: Path) -> bool:
    try:
        read_manifest(path)
    except BundleError:
        return False
    return True


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
