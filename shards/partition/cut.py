"""Cut a Keras model into pipeline stages and write them as a bundle; run a bundle's stages in
a chain the way the pipeline does, routing tensors by name.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import keras
import numpy as np

from shards.actor.precision import check_reduced
from shards.bundle.driver_combine import DriverCombine, combine_outputs
from shards.bundle.format import (
    FORMAT_VERSION,
    SAVEDMODEL_SUFFIX,
    Manifest,
    StageMemory,
    StagePart,
    StageSpec,
    import_modules,
    load_keras,
    load_stage,
    read_manifest,
    sha256_file,
    write_manifest,
)
from shards.errors import PlanError
from shards.partition.graph import Graph, PartitionError, analyse, cut, reanalyse
from shards.partition.length_bound import describe_bounds
from shards.partition.length_masks import describe_pad_values
from shards.partition.memory_plan import (
    MemoryModel,
    default_overhead,
    parse_budgets,
)
from shards.partition.plan import Plan, budget_text, plan_balanced, plan_budget
from shards.partition.savedmodel import read_savedmodel
from shards.partition.split import (
    LOGITS,
    Split,
    choose_splits,
    describe,
    hand_to_driver,
    parts_needed,
    split_model,
    uses,
)
from shards.signature import ModelSignature

__all__ = ["PartitionError", "partition_to_bundle", "plan", "plan_stages", "run_chain"]

Progress = Callable[[str], None]
# The server's default max_batch_size (serving.settings.config): the batch a plan sizes
# activations at.
DEFAULT_PLAN_BATCH_ROWS = 32


Budgets = int | Sequence[int]


def plan(
    graph: Graph,
    *,
    stages: int | None,
    max_stage_bytes: Budgets | None,
    memory: MemoryModel | None = None,
    isolated: frozenset[int] = frozenset(),
) -> Plan:
    """The cuts: ``stages`` balanced ones, or the fewest (one budget) or exactly one per device
    (a list of budgets) whose peak needs fit; without ``memory`` a budget counts weights only.
    A node in ``isolated`` (a part of a split layer) is a stage of its own."""
    costs = [n.cost for n in graph.nodes]

    def alone(a: int, b: int) -> bool:
        return b - a == 1 or not any(i in isolated for i in range(a, b))

    if stages is not None and max_stage_bytes is not None:
        raise PartitionError(
            f"give stages ({stages}) or max_stage_bytes ({max_stage_bytes}), not both"
        )
    if max_stage_bytes is not None:
        if memory is None:
            return plan_budget(costs, max_stage_bytes)
        return plan_budget(
            costs,
            max_stage_bytes,
            need=lambda a, b: memory.need(a, b).total if alone(a, b) else sys.maxsize,
            explain=lambda a, b: memory.need(a, b).explain(),
        )
    return plan_balanced(costs, 1 if stages is None else stages)


def _tf_sees_gpu() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def plan_stages(
    graph: Graph,
    *,
    stages: int | None = None,
    max_stage_bytes: Budgets | None = None,
    plan_batch_rows: int = DEFAULT_PLAN_BATCH_ROWS,
    device_overhead_bytes: int | None = None,
    weight_dtype: str | None = None,
) -> list[tuple[keras.Model, StageSpec]]:
    """Plan and cut: each stage's sub-model and its spec (``plan_bundle``'s stages)."""
    return plan_bundle(
        graph,
        stages=stages,
        max_stage_bytes=max_stage_bytes,
        plan_batch_rows=plan_batch_rows,
        device_overhead_bytes=device_overhead_bytes,
        weight_dtype=weight_dtype,
    ).stages


@dataclass(frozen=True)
class Planned:
    """A plan cut: each stage's sub-model and spec, and the model outputs the driver joins from
    a split layer's parts (``shards.bundle.driver_combine``)."""

    stages: list[tuple[keras.Model, StageSpec]]
    combines: tuple[DriverCombine, ...] = ()


def plan_bundle(
    graph: Graph,
    *,
    stages: int | None = None,
    max_stage_bytes: Budgets | None = None,
    plan_batch_rows: int = DEFAULT_PLAN_BATCH_ROWS,
    device_overhead_bytes: int | None = None,
    weight_dtype: str | None = None,
) -> Planned:
    """Plan and cut: each stage's sub-model and its spec, memory plan included (what
    ``partition`` writes and ``shardserve plan`` prints). ``device_overhead_bytes=None``: the
    default for a GPU when TensorFlow sees one here, else for a CPU. ``weight_dtype``: the
    weights will be served in it (``--weight-dtype``), and count at its size. A dimension
    unknown in the graph counts as ``graph.sequence_length``."""
    overhead = device_overhead_bytes
    if overhead is None:
        overhead = default_overhead(gpu=_tf_sees_gpu())
    weight_dtype = check_reduced(weight_dtype, "weight_dtype")
    if stages is not None and max_stage_bytes is not None:
        raise PartitionError(
            f"give stages ({stages}) or max_stage_bytes ({max_stage_bytes}), not both"
        )
    memory = MemoryModel(graph, plan_batch_rows, overhead, weight_dtype, graph.sequence_length)
    budgets = None if max_stage_bytes is None else parse_budgets(max_stage_bytes)
    whole = graph
    splits: list[Split] = []
    combines: tuple[DriverCombine, ...] = ()
    if budgets is not None:
        graph, memory, splits, combines = _split_oversized(graph, memory, budgets, weight_dtype)
    parts = _part_nodes(graph, splits)
    try:
        stage_plan = plan(
            graph,
            stages=stages,
            max_stage_bytes=budgets,
            memory=memory,
            isolated=frozenset(parts),
        )
    except PlanError as exc:
        if not splits:
            raise
        if len(budgets or ()) > 1:
            # Split, the model needs more devices than the list gives: the unsplit plan's
            # refusal names the layer that fits none of them.
            plan(whole, stages=stages, max_stage_bytes=budgets, memory=_memory_like(whole, memory))
        done = "; ".join(describe(s) for s in splits)
        raise PlanError(f"{exc.message} (with {done})") from None
    labels = _labels(stage_plan, parts)
    cut_stages = []
    for index, (start, end) in enumerate(stage_plan):
        stage, spec = cut(graph, start, end, index)
        part = parts.get(start) if end - start == 1 else None
        spec = replace(spec, label=labels[index], part=part)
        need = memory.need(start, end)
        budget = None if budgets is None else budgets[min(index, len(budgets) - 1)]
        spec = replace(
            spec,
            memory=StageMemory(
                first_layer=graph.nodes[start].name,
                last_layer=graph.nodes[end - 1].name,
                activation_bytes=need.activation_bytes,
                overhead_bytes=need.overhead_bytes,
                plan_batch_rows=plan_batch_rows,
                budget_bytes=budget,
                crossing_bytes_per_row=memory.crossing_bytes_per_row(start, end),
                unknown_dims=need.unknown_dims,
                weight_dtype=weight_dtype,
                weight_bytes=None if weight_dtype is None else need.weight_bytes,
                sequence_length=graph.sequence_length,
            ),
        )
        if budget is not None and spec.planned_peak_bytes > budget:
            # A guard: planning charges a reused layer's weights at every call
            # (shards.partition.graph),
            # so the stage cut holds no more than planned.
            raise PartitionError(
                f"stage {index} needs {spec.planned_peak_bytes} bytes ({spec.param_bytes} of "
                f"weights), over its budget {budget}; raise the budget"
            )
        cut_stages.append((stage, spec))
    return Planned(cut_stages, combines)


def _memory_like(graph: Graph, memory: MemoryModel) -> MemoryModel:
    return MemoryModel(
        graph,
        memory.plan_batch_rows,
        memory.overhead_bytes,
        memory.weight_dtype,
        graph.sequence_length,
    )


def _split_oversized(
    graph: Graph, memory: MemoryModel, budgets: Sequence[int], weight_dtype: str | None
) -> tuple[Graph, MemoryModel, list[Split], tuple[DriverCombine, ...]]:
    """``graph`` with each layer too large for the largest budget split into the fewest parts
    that fit it (``shards.partition.split``); the same graph where none is too large. A split
    layer whose combine would be a model output and nothing else is joined by the driver
    instead (the combines returned): its parts' outputs are the graph's outputs."""
    top = max(budgets)

    def over(i: int) -> tuple[int, str] | None:
        need = memory.need(i, i + 1)
        return (need.total, need.explain()) if need.total > top else None

    calls: dict[int, list[object]] = {}
    for gnode in graph.nodes:
        calls.setdefault(id(gnode.node.operation), []).append(gnode.node)

    def parts_for(i: int, op: object, how: str) -> int | None:
        # A tied table's lookups and its logits are split at the same rows, each use's parts
        # holding them (shards.partition.split): the count is the larger of the two uses'.
        weights = memory.need(i, i + 1).weight_bytes
        counts = [
            parts_needed(
                op,
                use_how,
                nodes,
                weights,
                memory.overhead_bytes,
                memory.plan_batch_rows,
                graph.sequence_length,
                top,
            )
            for use_how, nodes in uses(calls[id(op)], how)
        ]
        return None if None in counts else max(c for c in counts if c is not None)

    splits = choose_splits(graph.nodes, over, parts_for, budget_text(budgets))
    for _ in range(8):
        if not splits:
            return graph, memory, [], ()
        split, handed = hand_to_driver(split_model(graph.model, splits))
        names, combines = _driver_names(graph.signature.output_names, handed)
        split_graph = reanalyse(graph, split, names)
        split_memory = _memory_like(split_graph, memory)
        parts = _part_nodes(split_graph, splits)
        # The count was computed from shapes; a part the memory model finds over gets one more.
        grow = {
            p.layer
            for i, p in parts.items()
            if split_memory.need(i, i + 1).total > top and p.parts < splits_by(splits)[p.layer].size
        }
        if not grow:
            return split_graph, split_memory, splits, combines
        splits = [s.more() if s.layer in grow else s for s in splits]
    raise PlanError(f"cannot split {', '.join(s.layer for s in splits)} to fit {top} bytes")


def _driver_names(
    outputs: Sequence[str], handed: Mapping[int, DriverCombine]
) -> tuple[list[str], tuple[DriverCombine, ...]]:
    """The split model's output names (a handed output's parts named after their layers) and
    the combines, named."""
    names: list[str] = []
    combines: list[DriverCombine] = []
    for i, name in enumerate(outputs):
        if i not in handed:
            names.append(name)
            continue
        names.extend(handed[i].parts)
        combines.append(replace(handed[i], output=name))
    return names, tuple(combines)


def splits_by(splits: Sequence[Split]) -> dict[str, Split]:
    return {s.layer: s for s in splits}


def _part_nodes(graph: Graph, splits: Sequence[Split]) -> dict[int, StagePart]:
    """Node index -> the part of a split layer it is."""
    names = {
        s.part_name(k, use): StagePart(
            s.layer, s.kind, s.how, k, s.parts, s.bounds[k], s.bounds[k + 1], use
        )
        for s in splits
        for use in (None, LOGITS)
        if use is None or s.reversed
        for k in range(s.parts)
    }
    return {i: names[n.name] for i, n in enumerate(graph.nodes) if n.name in names}


def _labels(stage_plan: Plan, parts: dict[int, StagePart]) -> list[str]:
    """Each stage's position in the pipeline: parts of one split layer side by side ("3.0",
    "3.1"), every other stage a number of its own."""
    labels: list[str] = []
    step = 0
    group: dict[str, int] = {}
    for start, end in stage_plan:
        part = parts.get(start) if end - start == 1 else None
        if part is None:
            labels.append(str(step))
            step += 1
            continue
        if part.group not in group:
            group[part.group] = step
            step += 1
        labels.append(f"{group[part.group]}.{part.part}")
    return labels


def _sha256_model(model: keras.Model) -> str:
    # Not model.to_json(): Keras cannot serialise a model after sub-models were cut from it.
    layout = [(type(layer).__name__, layer.name) for layer in model.layers]
    digest = hashlib.sha256(repr(layout).encode())
    for weight in model.weights:
        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(weight)).tobytes())
    return digest.hexdigest()


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
) -> Manifest:
    """Cut ``model`` (a ``.keras`` file, a SavedModel directory or a model built in code) into
    stages and write ``manifest.json`` plus one file per stage into ``out_dir``.
    ``max_sequence_length``: what a dimension unknown in the graph is planned at; ``None``: the
    model's own bound (``shards.partition.length_bound``), else 512."""
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
    )
    report(f"planned {len(planned.stages)} stage(s) over {len(graph.nodes)} nodes")
    if (bounded := describe_bounds(graph.signature)) is not None:
        report(bounded)
    if (padded := describe_pad_values(graph.signature)) is not None:
        report(padded)
    specs = []
    for stage, spec in planned.stages:
        stage.save(out / spec.file)
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


def run_chain(
    bundle_dir: str | Path,
    inputs: Mapping[str, np.ndarray],
    imports: Sequence[str] = (),
    *,
    unsafe_deserialization: bool = False,
) -> dict[str, np.ndarray]:
    """Run a bundle's stages one after the other, each loaded on its own, routing every tensor
    by name from wherever it was produced (a model input or an earlier stage's output)."""
    manifest = read_manifest(bundle_dir)
    tensors: dict[str, np.ndarray] = dict(inputs)
    for spec in manifest.stages:
        stage = load_stage(
            bundle_dir,
            spec.index,
            imports or manifest.imports,
            unsafe_deserialization=unsafe_deserialization,
        )
        args = [tensors[t.name] for t in spec.inputs]
        result = stage(args[0] if len(args) == 1 else args, training=False)
        results = result if isinstance(result, list | tuple) else [result]
        for t, value in zip(spec.outputs, results, strict=True):
            tensors[t.name] = keras.ops.convert_to_numpy(value)
    tensors.update(combine_outputs(manifest.combines, tensors))
    return {t.name: tensors[t.name] for t in manifest.signature.outputs}
