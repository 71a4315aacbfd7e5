"""The on-disk bundle of a partitioned model: ``manifest.json`` plus one file per stage.

Reading a manifest needs only json and numpy, so the HTTP server can learn the model's signature
without importing TensorFlow; ``load_stage`` imports Keras lazily and loads one stage's file, so
no process ever builds the whole model.

A stage file ending in ``.keras`` is a Keras model; one ending in ``.savedmodel`` is a copied TF
SavedModel directory served whole through ``keras.layers.TFSMLayer``.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shards.bundle.fingerprint import built_with
from shards.errors import BundleError, ShardsError
from shards.signature import ModelSignature, TensorSpec
from shards.split import DriverCombine, StagePart, hosts, pipeline_depth, places

if TYPE_CHECKING:
    import keras

# 2: masks, nested models and shared layers cut anew (issue 17); the manifest records the code
# that cut the bundle (``built_with``). A version-1 bundle is refused, never served: its cuts of
# those models could give wrong answers.
# 3: a layer larger than one device split into parts, each a stage of its own (``StagePart``),
# stages labelled ("3.1": part 1 of the layer split at stage 3) and the split layers listed.
FORMAT_VERSION = 3
MANIFEST_NAME = "manifest.json"
SAVEDMODEL_SUFFIX = ".savedmodel"


@dataclass(frozen=True)
class StageSpec:
    index: int
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    param_bytes: int
    flops_per_row: int
    # The memory plan (shards.partition.memory_plan); absent from manifests written before it:
    # zeros.
    memory: StageMemory | None = None
    # A part of a split layer (shards.split): the stage holds only that part.
    part: StagePart | None = None
    # What logs, metrics and ``plan`` call it: its position in the pipeline, parts of one split
    # layer sharing theirs ("3.0", "3.1"); the index where nothing is split.
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or str(self.index)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "index": self.index,
            "file": self.file,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "param_bytes": self.param_bytes,
            "flops_per_row": self.flops_per_row,
        }
        if self.memory is not None:
            data["memory"] = self.memory.to_json()
        if self.label:
            data["label"] = self.label
        if self.part is not None:
            data["part"] = asdict(self.part)
        return data

    @property
    def planned_peak_bytes(self) -> int:
        """Weights + activations at the max batch + device overhead (weights alone in a
        manifest written before the memory plan)."""
        if self.memory is None:
            return self.param_bytes
        mem = self.memory
        weights = self.param_bytes if mem.weight_bytes is None else mem.weight_bytes
        return weights + mem.activation_bytes + mem.overhead_bytes

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageSpec:
        return cls(
            index=int(data["index"]),
            file=stage_file_name(data["file"]),
            inputs=tuple(TensorSpec.from_json(t) for t in data["inputs"]),
            outputs=tuple(TensorSpec.from_json(t) for t in data["outputs"]),
            param_bytes=int(data["param_bytes"]),
            flops_per_row=int(data["flops_per_row"]),
            memory=StageMemory.from_json(data["memory"]) if data.get("memory") else None,
            part=StagePart.from_json(data["part"]) if data.get("part") else None,
            label=str(data.get("label", "")),
        )


# A manifest's memory plan names its batch after the setting that chose it: the key every bundle
# already written on disk holds.
PLAN_BATCH_KEY = "max_batch_size"


@dataclass(frozen=True)
class StageMemory:
    """A stage's share of the memory plan, as ``shardserve plan`` prints it."""

    first_layer: str
    last_layer: str
    activation_bytes: int  # live at the stage's worst point, at plan_batch_rows rows
    overhead_bytes: int
    plan_batch_rows: int  # the batch the plan was made for (--max-batch-size at planning)
    budget_bytes: int | None  # the device's budget, when one was given
    crossing_bytes_per_row: int  # what the stage sends on (later stages, model outputs)
    unknown_dims: bool = False  # a dimension unknown in the graph was counted as sequence_length
    # Served in a reduced weight_dtype (bfloat16, float16): the weights at that size.
    weight_dtype: str | None = None
    weight_bytes: int | None = None
    # --max-sequence-length; a manifest written before it counted unknown dimensions as 1.
    sequence_length: int = 1

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data[PLAN_BATCH_KEY] = data.pop("plan_batch_rows")
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageMemory:
        budget = data.get("budget_bytes")
        served = data.get("weight_bytes")
        return cls(
            first_layer=str(data.get("first_layer", "")),
            last_layer=str(data.get("last_layer", "")),
            activation_bytes=int(data.get("activation_bytes", 0)),
            overhead_bytes=int(data.get("overhead_bytes", 0)),
            plan_batch_rows=int(data.get(PLAN_BATCH_KEY, 0)),
            budget_bytes=None if budget is None else int(budget),
            crossing_bytes_per_row=int(data.get("crossing_bytes_per_row", 0)),
            unknown_dims=bool(data.get("unknown_dims", False)),
            weight_dtype=None if data.get("weight_dtype") is None else str(data["weight_dtype"]),
            weight_bytes=None if served is None else int(served),
            sequence_length=int(data.get("sequence_length", 1)),
        )


@dataclass(frozen=True)
class Manifest:
    format_version: int
    signature: ModelSignature
    stages: tuple[StageSpec, ...]
    source: str
    source_sha256: str
    imports: tuple[str, ...] = ()
    # Keras and TensorFlow versions and the partitioner's source digest (shards.bundle.fingerprint).
    built_with: dict[str, str] = field(default_factory=built_with)
    # Model outputs joined by the driver from a split layer's parts (shards.split).
    combines: tuple[DriverCombine, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "signature": self.signature.to_json(),
            "stages": [s.to_json() for s in self.stages],
            "source": self.source,
            "source_sha256": self.source_sha256,
            "imports": list(self.imports),
            "built_with": dict(self.built_with),
            "depth": self.depth,
            "actors": self.actors,
            "splits": self.splits(),
            "combines": [c.to_json() for c in self.combines],
        }

    def splits(self) -> list[dict[str, Any]]:
        """Each split layer: how, into how many parts, and each part's stage, range, weights,
        activations and device budget (read from the stages; written for people and tools)."""
        found: dict[str, dict[str, Any]] = {}
        for stage in self.stages:
            if stage.part is None:
                continue
            p, mem = stage.part, stage.memory
            entry = found.setdefault(
                p.group,
                {"layer": p.layer, "kind": p.kind, "how": p.how, "parts": p.parts, "use": p.use},
            )
            entry.setdefault("stages", []).append(
                {
                    "stage": stage.index,
                    "label": stage.name,
                    "start": p.start,
                    "stop": p.stop,
                    "weight_bytes": stage.param_bytes,
                    "activation_bytes": None if mem is None else mem.activation_bytes,
                    "budget_bytes": None if mem is None else mem.budget_bytes,
                    # Run by the actor of that stage, which holds these rows (a tied table).
                    "held_by": p.held_by,
                }
            )
        return list(found.values())

    @property
    def depth(self) -> int:
        """Places one after the other in the pipeline: the parts of a split layer run side by
        side and count once (``shards.split.pipeline_depth``). Every consumer reads this one
        count: the pipeline's in-flight window, the server's batcher limits and queue sizes."""
        return pipeline_depth([s.part for s in self.stages])

    @property
    def places(self) -> list[int]:
        """Each stage's place in the pipeline (``shards.split.places``)."""
        return places([s.part for s in self.stages])

    @property
    def hosts(self) -> list[int]:
        """Each stage's host: the stage whose actor runs it (``shards.split.hosts``; a tied
        table held once runs part k's logits in part k's lookup actor)."""
        return hosts([s.part for s in self.stages])

    @property
    def actors(self) -> int:
        """Stage actors a replica starts (devices it takes): one per host."""
        return len(set(self.hosts))

    def actor_peak_bytes(self, host: int) -> int:
        """The planned peak of the actor that runs stage ``host`` and its guests: the host's
        plan plus each guest's activations (their rows are the host's, counted once)."""
        guests = [s for s, h in zip(self.stages, self.hosts, strict=True) if h == host]
        extra = sum(
            s.memory.activation_bytes if s.memory is not None else 0
            for s in guests
            if s.index != host
        )
        return self.stages[host].planned_peak_bytes + extra

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        version = data.get("format_version")
        if version == 2:
            raise BundleError(
                "the bundle was cut by an older shardserve (manifest format_version 2), which "
                "does not split a layer larger than one device nor label its stages; "
                "re-partition the source model with this version (shardserve partition MODEL "
                "--out DIR)"
            )
        if version == 1:
            raise BundleError(
                "the bundle was cut by an older shardserve (manifest format_version 1), whose "
                "cuts of masked, nested and shared-layer models can give wrong answers; "
                "re-partition the source model with this version (shardserve partition MODEL "
                "--out DIR)"
            )
        if version != FORMAT_VERSION:
            raise BundleError(
                f"manifest format_version is {version!r}; this shardserve reads version "
                f"{FORMAT_VERSION} (re-partition the model with this version)"
            )
        return cls(
            format_version=FORMAT_VERSION,
            signature=ModelSignature.from_json(data["signature"]),
            stages=tuple(StageSpec.from_json(s) for s in data["stages"]),
            source=str(data["source"]),
            source_sha256=str(data["source_sha256"]),
            imports=tuple(str(m) for m in data.get("imports", ())),
            built_with={str(k): str(v) for k, v in data.get("built_with", {}).items()},
            combines=tuple(DriverCombine.from_json(c) for c in data.get("combines", ())),
        )

    @property
    def total_param_bytes(self) -> int:
        return sum(s.param_bytes for s in self.stages)


def stage_file_name(name: Any) -> str:
    """A manifest's stage ``file``, refused unless it is one plain name inside the bundle: the
    manifest comes from whoever wrote the bundle, and ``../x`` or ``/x`` would load (run) a file
    from anywhere on the node."""
    text = name if isinstance(name, str) else ""
    if text in ("", ".", "..") or any(c in text for c in ("/", "\\", "\0")):
        raise BundleError(
            f"stage file {name!r} in the manifest is not a plain file name inside the bundle "
            "(no '/', '\\', '..' or empty name); re-partition the model with shardserve "
            "partition"
        )
    return text


def read_manifest(bundle_dir: str | Path) -> Manifest:
    bundle = Path(bundle_dir)
    if not bundle.is_dir():
        raise BundleError(f"bundle directory {str(bundle)!r} does not exist or is not a directory")
    path = bundle / MANIFEST_NAME
    if not path.is_file():
        raise BundleError(
            f"{str(bundle)!r} has no {MANIFEST_NAME}; expected a bundle written by "
            "`shardserve partition`"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"cannot read {str(path)!r} as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BundleError(f"{str(path)!r} holds a {type(data).__name__}; expected a JSON object")
    try:
        return Manifest.from_json(data)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, BundleError):
            raise
        raise BundleError(f"{str(path)!r} is not a valid manifest: {exc!r}") from exc


def write_manifest(bundle_dir: str | Path, manifest: Manifest) -> None:
    path = Path(bundle_dir) / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def import_modules(names: Iterable[str]) -> None:
    """Import the modules that register a model's custom layers before a stage is loaded."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise BundleError(
                f"cannot import module {name!r} listed in the bundle's imports ({exc}); "
                "install it or put it on PYTHONPATH"
            ) from exc


UNSAFE_FLAG = "--unsafe-deserialization"


def allowed_imports(
    manifest: Manifest, imports: Sequence[str], *, unsafe_deserialization: bool
) -> tuple[str, ...]:
    """The modules a stage of ``manifest`` is loaded with: the operator's ``imports`` and the
    bundle's own. Importing a module runs its code, and the manifest says only what whoever wrote
    the bundle wanted, so a module of the bundle's that the operator did not name (``--import``)
    is refused unless ``unsafe_deserialization`` trusts the bundle whole."""
    unlisted = [m for m in manifest.imports if m not in imports]
    if unlisted and not unsafe_deserialization:
        names = ", ".join(map(repr, unlisted))
        flags = " ".join(f"--import {m}" for m in unlisted)
        raise BundleError(
            f"the bundle's manifest asks to import {names}, which the server was not told to "
            f"import; importing a module runs its code: pass {flags} if you trust it (or "
            f"{UNSAFE_FLAG} to trust the bundle whole)"
        )
    return tuple(dict.fromkeys((*manifest.imports, *imports)))


def load_keras(
    path: Path, what: str, *, unsafe_deserialization: bool, error: type[ShardsError] = BundleError
) -> keras.Model:
    """``keras.saving.load_model`` in Keras's safe mode unless ``unsafe_deserialization``: a
    Lambda layer (Python bytecode) then fails with one line naming the flag that allows it."""
    import keras

    import shards.bundle.masking  # noqa: F401 - registers CarryMask, which a cut may hold
    from shards.split import register_layers

    register_layers()

    try:
        return keras.saving.load_model(path, compile=False, safe_mode=not unsafe_deserialization)
    except (TypeError, ValueError) as exc:
        if unsafe_deserialization or "safe_mode" not in str(exc):
            raise
    raise error(
        f"{what} holds a Lambda layer or other Python code, which is loaded only with "
        f"{UNSAFE_FLAG} (unsafe_deserialization=True); pass it if you trust the model's source"
    )


def load_stage(
    bundle_dir: str | Path,
    index: int,
    imports: Iterable[str] = (),
    *,
    unsafe_deserialization: bool = False,
) -> keras.Model:
    import_modules(imports)
    manifest = read_manifest(bundle_dir)
    if not 0 <= index < len(manifest.stages):
        raise BundleError(
            f"stage index {index} is out of range; the bundle has {len(manifest.stages)} stages"
        )
    spec = manifest.stages[index]
    path = Path(bundle_dir) / spec.file
    if not path.exists():
        raise BundleError(f"stage {index} file {str(path)!r} is missing from the bundle")
    if spec.file.endswith(SAVEDMODEL_SUFFIX):
        return _wrap_savedmodel(path, spec)
    return load_keras(
        path, f"stage {index} ({spec.file})", unsafe_deserialization=unsafe_deserialization
    )


def _wrap_savedmodel(path: Path, spec: StageSpec) -> keras.Model:
    """A Keras model over the SavedModel's ``serving_default`` signature, inputs and outputs in
    the stage's order. ``TFSMLayer`` alone passes one positional argument, which a signature with
    several named inputs refuses, so the call binds them by name."""
    import keras

    input_names = [t.name for t in spec.inputs]
    output_names = [t.name for t in spec.outputs]

    class SignatureLayer(keras.layers.TFSMLayer):  # type: ignore[misc]
        def call(self, inputs: Any, training: bool = False) -> Any:
            args = inputs if isinstance(inputs, list | tuple) else [inputs]
            out = self.call_endpoint_fn(**dict(zip(input_names, args, strict=True)))
            return [out[n] for n in output_names]

    layer = SignatureLayer(str(path), call_endpoint="serving_default", name="savedmodel")
    inputs = [keras.Input(shape=t.shape, dtype=t.dtype, name=t.name) for t in spec.inputs]
    outputs = layer(inputs)
    return keras.Model(
        inputs=inputs[0] if len(inputs) == 1 else inputs,
        outputs=outputs[0] if len(outputs) == 1 else outputs,
    )


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (stage files can be gigabytes)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
