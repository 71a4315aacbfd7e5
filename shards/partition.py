"""Cut a Keras model into pipeline stages and write them as a bundle.

The model's layer graph is walked as a list of nodes (layer calls, so a layer called twice is two
nodes) in topological order; a stage is a contiguous range of that list. A stage's inputs are the
tensors produced before the range (or model inputs) and consumed in it; its outputs are the
tensors produced in it that later stages consume or that are model outputs. A tensor that a
later stage needs but this stage does not produce is never routed through it (Keras cannot output
a tensor a sub-model merely hands on): the driver routes every tensor by name from wherever it was
produced, as ``run_chain`` does.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np

from shards.bundle import (
    FORMAT_VERSION,
    SAVEDMODEL_SUFFIX,
    Manifest,
    StageSpec,
    import_modules,
    load_stage,
    read_manifest,
    write_manifest,
)
from shards.plan import NodeCost, Plan, estimate_flops, param_bytes, plan_balanced, plan_budget
from shards.signature import ModelSignature, TensorSpec

Progress = Callable[[str], None]


class PartitionError(ValueError):
    """The model or the request cannot be partitioned (wrong source, options, graph)."""


@dataclass(frozen=True)
class GraphNode:
    name: str
    node: Any  # the Keras Node: the call to replay when the stage is built
    inputs: tuple[Any, ...]  # KerasTensors, deduplicated, in call order
    outputs: tuple[Any, ...]
    cost: NodeCost


@dataclass(frozen=True)
class Graph:
    model: keras.Model
    nodes: tuple[GraphNode, ...]
    tensor_names: dict[int, str]  # id(KerasTensor) -> bundle-wide name
    input_ids: tuple[int, ...]  # model inputs, in the model's order
    output_ids: tuple[int, ...]
    signature: ModelSignature


def _spec(tensor: Any, name: str) -> TensorSpec:
    return TensorSpec(name=name, shape=tuple(tensor.shape[1:]), dtype=str(tensor.dtype))


def _named(struct: Any, flat: Sequence[Any], fallback: Sequence[str]) -> list[str]:
    """Names of a model's flat inputs/outputs: dict keys when the model was built with a dict."""
    if isinstance(struct, dict):
        by_id = {id(t): str(k) for k, t in struct.items()}
        return [by_id[id(t)] for t in flat]
    return list(fallback)


def _unique(name: str, taken: set[str]) -> str:
    candidate, k = name, 1
    while candidate in taken:
        candidate, k = f"{name}_{k}", k + 1
    taken.add(candidate)
    return candidate


def as_functional(model: keras.Model) -> keras.Model:
    if isinstance(model, keras.Sequential):
        try:
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError) as exc:
            raise PartitionError(
                f"Sequential model {model.name!r} has no known input shape; start it with "
                "keras.Input(shape=...) so it can be cut"
            ) from exc
        return keras.Model(inputs=inputs, outputs=outputs, name=model.name)
    if not hasattr(model, "_inputs_struct"):
        raise PartitionError(
            f"model {model.name!r} is a subclassed {type(model).__name__}; only Sequential and "
            "functional models have a layer graph to cut"
        )
    return model


def _topological_nodes(model: keras.Model) -> list[Any]:
    """Keras nodes (skipping Input layers) in DFS post-order from the outputs: a topological
    order that keeps each branch together, so fewer tensors cross a cut."""
    order: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = []
    for tensor in reversed(model.outputs):
        op, node_index, _ = tensor._keras_history
        stack.append((op._inbound_nodes[node_index], False))
    while stack:
        node, expanded = stack.pop()
        if id(node) in seen:
            continue
        if expanded:
            seen.add(id(node))
            if not node.is_input:
                order.append(node)
            continue
        stack.append((node, True))
        for tensor in reversed(node.input_tensors):
            op, node_index, _ = tensor._keras_history
            parent = op._inbound_nodes[node_index]
            if id(parent) not in seen:
                stack.append((parent, False))
    return order


def analyse(model: keras.Model) -> Graph:
    model = as_functional(model)
    input_names = _named(model._inputs_struct, model.inputs, [t.name for t in model.inputs])
    output_names = _named(model._outputs_struct, model.outputs, model.output_names)
    taken: set[str] = set()
    names: dict[int, str] = {}
    for tensor, name in zip(model.inputs, input_names, strict=True):
        names[id(tensor)] = _unique(name, taken)
    for tensor, name in zip(model.outputs, output_names, strict=True):
        if id(tensor) in names:
            raise PartitionError(
                f"model output {name!r} is the model input {names[id(tensor)]!r} itself or "
                "another output; serve a model whose outputs are computed by layers"
            )
        names[id(tensor)] = _unique(name, taken)

    nodes: list[GraphNode] = []
    counted_ops: set[int] = set()
    calls: dict[int, int] = {}
    for node in _topological_nodes(model):
        op = node.operation
        calls[id(op)] = calls.get(id(op), 0) + 1
        outputs = tuple(node.output_tensors)
        for k, tensor in enumerate(outputs):
            if id(tensor) not in names:
                suffix = "" if calls[id(op)] == 1 else f"_call{calls[id(op)]}"
                suffix += "" if len(outputs) == 1 else f"_out{k}"
                names[id(tensor)] = _unique(f"{op.name}{suffix}", taken)
        inputs = tuple({id(t): t for t in node.input_tensors}.values())
        # A reused layer's weights are counted at its first call only.
        weight_bytes = 0 if id(op) in counted_ops else param_bytes(op)
        counted_ops.add(id(op))
        cost = NodeCost(op.name, weight_bytes, estimate_flops(op, inputs, outputs))
        nodes.append(GraphNode(op.name, node, inputs, outputs, cost))

    signature = ModelSignature(
        name=model.name,
        inputs=tuple(_spec(t, names[id(t)]) for t in model.inputs),
        outputs=tuple(_spec(t, names[id(t)]) for t in model.outputs),
    )
    return Graph(
        model=model,
        nodes=tuple(nodes),
        tensor_names=names,
        input_ids=tuple(id(t) for t in model.inputs),
        output_ids=tuple(id(t) for t in model.outputs),
        signature=signature,
    )


def plan(graph: Graph, *, stages: int | None, max_stage_bytes: int | None) -> Plan:
    costs = [n.cost for n in graph.nodes]
    if stages is not None and max_stage_bytes is not None:
        raise PartitionError(
            f"give stages ({stages}) or max_stage_bytes ({max_stage_bytes}), not both"
        )
    if max_stage_bytes is not None:
        return plan_budget(costs, max_stage_bytes)
    return plan_balanced(costs, 1 if stages is None else stages)


def _replay(
    graph: Graph, start: int, end: int, ins: list[Any], outs: list[Any], name: str
) -> keras.Model:
    """Call the range's layers again on fresh ``keras.Input``s. Not ``keras.Model(inputs=
    <intermediate tensors>)``: its graph cloning swaps every call of the layer that produced an
    intermediate input for the new Input, which breaks a reused layer called inside the stage."""
    mapping: dict[int, Any] = {}
    # Input layers share the stage's namespace of operation names (the bundle's tensor names
    # are often layer names).
    taken = {n.node.operation.name for n in graph.nodes[start:end]}
    for tensor in ins:
        input_name = _unique(graph.tensor_names[id(tensor)], taken)
        mapping[id(tensor)] = keras.Input(
            batch_shape=tensor.shape, dtype=tensor.dtype, name=input_name
        )

    def substitute(value: Any) -> Any:
        return mapping[id(value)] if isinstance(value, keras.KerasTensor) else value

    for gnode in graph.nodes[start:end]:
        args = keras.tree.map_structure(substitute, gnode.node.arguments.args)
        kwargs = keras.tree.map_structure(substitute, gnode.node.arguments.kwargs)
        result = gnode.node.operation(*args, **kwargs)
        for old, new in zip(gnode.outputs, keras.tree.flatten(result), strict=True):
            mapping[id(old)] = new
    new_ins = [mapping[id(t)] for t in ins]
    new_outs = [mapping[id(t)] for t in outs]
    return keras.Model(
        inputs=new_ins[0] if len(new_ins) == 1 else new_ins,
        outputs=new_outs[0] if len(new_outs) == 1 else new_outs,
        name=name,
    )


def cut(graph: Graph, start: int, end: int, index: int) -> tuple[keras.Model, StageSpec]:
    """The sub-model over nodes[start:end] and its spec (file named after the index)."""
    produced: set[int] = set()
    inputs: dict[int, Any] = {}
    for node in graph.nodes[start:end]:
        for tensor in node.inputs:
            if id(tensor) not in produced:
                inputs.setdefault(id(tensor), tensor)
        produced.update(id(t) for t in node.outputs)
    needed_later = {id(t) for node in graph.nodes[end:] for t in node.inputs}
    needed_later.update(graph.output_ids)
    outputs = [t for node in graph.nodes[start:end] for t in node.outputs if id(t) in needed_later]
    ins, outs = list(inputs.values()), outputs
    stage = _replay(graph, start, end, ins, outs, name=f"stage_{index:03d}")
    names = graph.tensor_names
    spec = StageSpec(
        index=index,
        file=f"stage_{index:03d}.keras",
        inputs=tuple(_spec(t, names[id(t)]) for t in ins),
        outputs=tuple(_spec(t, names[id(t)]) for t in outs),
        param_bytes=param_bytes(stage),
        flops_per_row=sum(n.cost.flops_per_row for n in graph.nodes[start:end]),
    )
    return stage, spec


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
    max_stage_bytes: int | None = None,
    imports: Sequence[str] = (),
    source_name: str | None = None,
    progress: Progress | None = None,
) -> Manifest:
    """Cut ``model`` (a ``.keras`` file, a SavedModel directory or a model built in code) into
    stages and write ``manifest.json`` plus one file per stage into ``out_dir``."""
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
        sha = _sha256_file(path)
        model = keras.saving.load_model(path, compile=False)
    _prepare_out_dir(out)
    graph = analyse(model)
    stage_plan = plan(graph, stages=stages, max_stage_bytes=max_stage_bytes)
    report(f"planned {len(stage_plan)} stage(s) over {len(graph.nodes)} nodes")
    specs = []
    for index, (start, end) in enumerate(stage_plan):
        stage, spec = cut(graph, start, end, index)
        stage.save(out / spec.file)
        report(
            f"stage {index}: nodes {start}..{end - 1}, {len(spec.inputs)} input(s), "
            f"{len(spec.outputs)} output(s), {spec.param_bytes} weight bytes -> {spec.file}"
        )
        specs.append(spec)
    manifest = Manifest(FORMAT_VERSION, graph.signature, tuple(specs), source, sha, tuple(imports))
    write_manifest(out, manifest)
    report(f"wrote {out / 'manifest.json'}")
    return manifest


def _savedmodel_bundle(
    path: Path,
    out: Path,
    stages: int | None,
    max_stage_bytes: int | None,
    imports: Sequence[str],
    source: str,
    report: Progress,
) -> Manifest:
    """A SavedModel that is not a Keras model has no layer graph: it is served whole."""
    if (stages is not None and stages != 1) or max_stage_bytes is not None:
        raise PartitionError(
            f"{str(path)!r} is a TF SavedModel, which is served as one stage; it cannot be "
            f"sharded (got stages={stages}, max_stage_bytes={max_stage_bytes}). Save the model "
            "as a .keras file to shard it"
        )
    import tensorflow as tf

    _prepare_out_dir(out)
    report(f"reading SavedModel {path}")
    loaded = tf.saved_model.load(str(path))
    if "serving_default" not in loaded.signatures:
        raise PartitionError(f"SavedModel {str(path)!r} has no 'serving_default' signature")
    fn = loaded.signatures["serving_default"]
    in_specs = fn.structured_input_signature[1]
    out_specs = fn.structured_outputs

    def spec(name: str, ts: Any) -> TensorSpec:
        return TensorSpec(name, tuple(ts.shape.as_list()[1:]), ts.dtype.name)

    inputs = tuple(spec(n, in_specs[n]) for n in sorted(in_specs))
    outputs = tuple(spec(n, out_specs[n]) for n in sorted(out_specs))
    file = f"stage_000{SAVEDMODEL_SUFFIX}"
    shutil.copytree(path, out / file)
    weight_bytes = sum(int(np.prod(v.shape)) * v.dtype.size for v in loaded.variables)
    stage = StageSpec(0, file, inputs, outputs, weight_bytes, 0)
    signature = ModelSignature(path.name, inputs, outputs)
    sha = hashlib.sha256((path / "saved_model.pb").read_bytes()).hexdigest()
    manifest = Manifest(FORMAT_VERSION, signature, (stage,), source, sha, tuple(imports))
    write_manifest(out, manifest)
    report(f"wrote 1-stage bundle for SavedModel {path} to {out}")
    return manifest


def run_chain(
    bundle_dir: str | Path, inputs: Mapping[str, np.ndarray], imports: Sequence[str] = ()
) -> dict[str, np.ndarray]:
    """Run a bundle's stages one after the other, each loaded on its own, routing every tensor
    by name from wherever it was produced (a model input or an earlier stage's output)."""
    manifest = read_manifest(bundle_dir)
    tensors: dict[str, np.ndarray] = dict(inputs)
    for spec in manifest.stages:
        stage = load_stage(bundle_dir, spec.index, imports or manifest.imports)
        args = [tensors[t.name] for t in spec.inputs]
        result = stage(args[0] if len(args) == 1 else args, training=False)
        results = result if isinstance(result, list | tuple) else [result]
        for t, value in zip(spec.outputs, results, strict=True):
            tensors[t.name] = keras.ops.convert_to_numpy(value)
    return {t.name: tensors[t.name] for t in manifest.signature.outputs}
