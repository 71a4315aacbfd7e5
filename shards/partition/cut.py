"""Cut a model into a bundle on disk: load it (a ``.keras`` file, a SavedModel directory or a
model built in code), plan and cut its stages (``shards.partition.stages``), and write each
stage's file and the manifest.
"""

from __future__ import annotations

import hashlib
import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import keras
import numpy as np

from shards.bundle.format import (
    FORMAT_VERSION,
    SAVEDMODEL_SUFFIX,
    Manifest,
    StageSpec,
    import_modules,
    load_keras,
    sha256_file,
    write_manifest,
)
from shards.partition.graph import PartitionError, analyse
from shards.partition.length_bound import describe_bounds
from shards.partition.length_masks import describe_pad_values
from shards.partition.savedmodel import read_savedmodel
from shards.partition.stages import DEFAULT_PLAN_BATCH_ROWS, Budgets, plan_bundle
from shards.signature import ModelSignature
from shards.split import DEFAULT_LOOKUP_COMBINE

__all__ = ["PartitionError", "is_savedmodel_dir", "partition_to_bundle"]

Progress = Callable[[str], None]
# Bytes of a weight hashed at a time.
_HASH_BLOCK = 16 << 20


def _sha256_model(model: keras.Model) -> str:
    # Not model.to_json(): Keras cannot serialise a model after sub-models were cut from it.
    layout = [(type(layer).__name__, layer.name) for layer in model.layers]
    digest = hashlib.sha256(repr(layout).encode())
    for weight in model.weights:
        # Row block by row block (the same bytes in the same order, so the same digest): a
        # whole copy of a 1 GB table, then its bytes, held the partitioner's peak at 2 GB over it.
        value = weight.value if hasattr(weight, "value") else weight
        shape = tuple(int(d) for d in value.shape)
        if not shape:
            digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(value)).tobytes())
            continue
        row = max(1, math.prod(shape[1:]) * np.dtype(str(weight.dtype)).itemsize)
        step = max(1, _HASH_BLOCK // row)
        for start in range(0, shape[0], step):
            block = keras.ops.convert_to_numpy(value[start : start + step])
            digest.update(np.ascontiguousarray(block).tobytes())
    return digest.hexdigest()


def _save_stage(stage: keras.Model, path: Path) -> None:
    """``stage.save(path)``, its weights written through a file beside it rather than memory.

    Keras writes a ``.keras`` file's weights into memory first, then copies them into the zip,
    whenever they are under half the free memory: two copies of the stage's weights, on top of
    the one it reads out. A split layer's part is read out of the model only as it is written
    (``shards.split``): through the file, writing it holds one copy at most."""
    from keras.src.saving import saving_lib

    sufficient = saving_lib.is_memory_sufficient
    saving_lib.is_memory_sufficient = lambda _model: False
    try:
        stage.save(path)
    finally:
        saving_lib.is_memory_sufficient = sufficient


def is_savedmodel_dir(path: Path) -> bool:
    return path.is_dir() and (path / "saved_model.pb").is_file()


def _prepare_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise PartitionError(
            f"output directory {str(out_dir)!r} exists and is not empty; remove it or choose "
            "another"
        )
    out_dir.mkdir(parents=True, exist_ok=True)


def partition_to_bundle(
    model: str | Path | keras.Model,
    out_dir: str | Path,
    *,
    stages: int | None = None,
    max_stage_bytes: Budgets | None = None,
    imports: Sequence[str] = (),
    source_name: str | None = None,
    progress: Progress | None = None,
    plan_batch_rows: int = DEFAULT_PLAN_BATCH_ROWS,
    device_overhead_bytes: int | None = None,
    unsafe_deserialization: bool = False,
    weight_dtype: str | None = None,
    max_sequence_length: int | None = None,
    lookup_combine: str = DEFAULT_LOOKUP_COMBINE,
    pair_dense: bool = True,
    tied_tables: str = "once",
) -> Manifest:
    """Cut ``model`` (a ``.keras`` file, a SavedModel directory or a model built in code) into
    stages and write ``manifest.json`` plus one file per stage into ``out_dir``.
    ``max_sequence_length``: what a dimension unknown in the graph is planned at; ``None``: the
    model's own bound (``shards.partition.length_bound``), else 512. ``lookup_combine``: how a
    table split by rows is joined (``shards.split.split_model``). ``pair_dense=False``: no Dense
    pairs (``plan_bundle``). ``tied_tables``: a tied table
    split is held ``once`` (one actor per part serves its lookups and its logits) or ``twice``."""
    report = progress or (lambda _msg: None)
    import_modules(imports)
    out = Path(out_dir)
    if isinstance(model, keras.Model):
        source, sha = source_name or model.name, _sha256_model(model)
    else:
        path = Path(model)
        source = source_name or path.name
        if is_savedmodel_dir(path):
            return _savedmodel_bundle(path, out, stages, max_stage_bytes, imports, source, report)
        if not (path.is_file() and path.suffix == ".keras"):
            raise PartitionError(
                f"{str(path)!r} is not a .keras file or a SavedModel directory "
                "(a directory with saved_model.pb)"
            )
        report(f"loading {path}")
        sha = sha256_file(path)
        model = load_keras(
            path,
            repr(str(path)),
            unsafe_deserialization=unsafe_deserialization,
            error=PartitionError,
        )
    _prepare_out_dir(out)
    graph = analyse(model, max_sequence_length)
    planned = plan_bundle(
        graph,
        stages=stages,
        max_stage_bytes=max_stage_bytes,
        plan_batch_rows=plan_batch_rows,
        device_overhead_bytes=device_overhead_bytes,
        weight_dtype=weight_dtype,
        lookup_combine=lookup_combine,
        pair_dense=pair_dense,
        tied_tables=tied_tables,
    )
    report(f"planned {len(planned.stages)} stage(s) over {len(graph.nodes)} nodes")
    if (bounded := describe_bounds(graph.signature)) is not None:
        report(bounded)
    if (padded := describe_pad_values(graph.signature)) is not None:
        report(padded)
    specs = []
    for stage, spec in planned.stages:
        _save_stage(stage, out / spec.file)
        report(
            f"stage {spec.index}: {len(spec.inputs)} input(s), {len(spec.outputs)} output(s), "
            f"{spec.param_bytes} weight bytes, planned peak {spec.planned_peak_bytes} bytes "
            f"-> {spec.file}"
        )
        specs.append(spec)
    manifest = Manifest(
        FORMAT_VERSION,
        graph.signature,
        tuple(specs),
        source,
        sha,
        tuple(imports),
        combines=planned.combines,
    )
    write_manifest(out, manifest)
    report(f"wrote {out / 'manifest.json'}")
    return manifest


def _savedmodel_bundle(
    path: Path,
    out: Path,
    stages: int | None,
    max_stage_bytes: Budgets | None,
    imports: Sequence[str],
    source: str,
    report: Progress,
) -> Manifest:
    """A SavedModel that is not a Keras model has no layer graph: it is served whole."""
    if (stages is not None and stages != 1) or max_stage_bytes is not None:
        raise PartitionError(
            f"{path.name!r} is a TF SavedModel, which is served as one stage; it cannot be "
            f"sharded (got stages={stages}, max_stage_bytes={max_stage_bytes}). Save the model "
            "as a .keras file to shard it"
        )
    _prepare_out_dir(out)
    report(f"reading SavedModel {path}")
    info = read_savedmodel(path)
    file = f"stage_000{SAVEDMODEL_SUFFIX}"
    shutil.copytree(path, out / file)
    stage = StageSpec(0, file, info.inputs, info.outputs, info.weight_bytes, 0)
    signature = ModelSignature(path.name, info.inputs, info.outputs)
    sha = sha256_file(path / "saved_model.pb")
    manifest = Manifest(FORMAT_VERSION, signature, (stage,), source, sha, tuple(imports))
    write_manifest(out, manifest)
    report(f"wrote 1-stage bundle for SavedModel {path} to {out}")
    return manifest
