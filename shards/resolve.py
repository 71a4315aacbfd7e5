"""Turn what the user named as ``--model`` into a bundle directory, partitioning on the fly.

Accepted: a bundle directory, a ``.keras`` file, a TF SavedModel directory, or a demo model name.
Partitioned bundles are cached under ``cache_dir`` by the source's content and the options, and
written to a temporary directory that is renamed into place, so a crash or a concurrent resolver
never leaves a half-written bundle where a later call would reuse it.

TensorFlow is imported only when a model must be partitioned (inside the function), so importing
this module is cheap; callers run it in a Ray task to keep TensorFlow out of the HTTP process.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from shards.bundle import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    BundleError,
    Manifest,
    read_manifest,
    sha256_file,
)
from shards.errors import ResolveError
from shards.memory import parse_budgets

if TYPE_CHECKING:
    import keras


DEMO_NAMES = ("demo-tiny", "demo-mlp", "demo-resnet")
ACCEPTED = (
    "a bundle directory (with manifest.json), a .keras file, a TF SavedModel directory (with "
    f"saved_model.pb), or a demo model name ({', '.join(DEMO_NAMES)})"
)


def resolve_bundle(
    model: str,
    *,
    stages: int | None,
    max_stage_bytes: int | Sequence[int] | None,
    imports: Sequence[str] = (),
    cache_dir: Path,
    progress: Callable[[str], None] | None = None,
    max_batch_size: int = 32,
    device_overhead_bytes: int | None = None,
    unsafe_deserialization: bool = False,
    weight_dtype: str | None = None,
) -> Path:
    """``max_batch_size`` and ``device_overhead_bytes`` size the memory plan (shards.memory);
    ``unsafe_deserialization`` lets a ``.keras`` file with Lambda layers load."""
    path = Path(model).expanduser()
    budgets = None if max_stage_bytes is None else parse_budgets(max_stage_bytes)
    if (path / MANIFEST_NAME).is_file():
        _check_bundle_options(path, read_manifest(path), stages, budgets)
        return path
    options = f"stages={stages};max_stage_bytes={budgets};imports={list(imports)}"
    options += f";format={FORMAT_VERSION};batch={max_batch_size};overhead={device_overhead_bytes}"
    if weight_dtype not in (None, "float32"):
        options += f";weights={weight_dtype}"
    if path.is_dir() and (path / "saved_model.pb").is_file():
        key = _sha256(sha256_file(path / "saved_model.pb") + options)
    elif path.is_file() and path.suffix == ".keras":
        key = _sha256(sha256_file(path) + options)
    elif model in DEMO_NAMES:
        key = f"{model}-{_sha256(options)[:16]}"
    elif path.exists():
        raise ResolveError(f"cannot serve {model!r}: expected {ACCEPTED}")
    else:
        raise ResolveError(f"{model!r} does not exist and is not a demo model; expected {ACCEPTED}")

    final = Path(cache_dir) / key
    if _is_bundle(final):
        return final
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".partial-{key[:24]}-", dir=cache_dir))
    try:
        plan = _MemoryOptions(budgets, max_batch_size, device_overhead_bytes, weight_dtype)
        _partition(model, path, tmp, stages, plan, imports, progress, unsafe_deserialization)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another resolver finished the same bundle first; its copy is as good as ours.
            if not _is_bundle(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _partition(
    model: str,
    path: Path,
    out: Path,
    stages: int | None,
    memory: _MemoryOptions,
    imports: Sequence[str],
    progress: Callable[[str], None] | None,
    unsafe_deserialization: bool,
) -> Manifest:
    from shards.partition import partition_to_bundle

    if path.exists():
        source: Path | keras.Model = path
        name = None
    else:
        from shards.models import build_demo

        source, name = build_demo(model), f"demo:{model}"
    return partition_to_bundle(
        source,
        out,
        stages=stages,
        max_stage_bytes=memory.budgets,
        imports=imports,
        source_name=name,
        progress=progress,
        max_batch_size=memory.max_batch_size,
        device_overhead_bytes=memory.overhead_bytes,
        weight_dtype=memory.weight_dtype,
        unsafe_deserialization=unsafe_deserialization,
    )


class _MemoryOptions(NamedTuple):
    budgets: tuple[int, ...] | None
    max_batch_size: int
    overhead_bytes: int | None
    weight_dtype: str | None


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
