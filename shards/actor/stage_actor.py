"""One pipeline stage: the body of a Ray actor that holds one stage's weights and runs it.

A plain class; ``pipeline.py`` wraps it with ``ray.remote`` so the resource options live in one
place. TensorFlow is imported inside the methods: the serving process imports this module (to
wrap the class) and must never load TensorFlow itself.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from shards.actor.compute_log import ComputeLog
from shards.actor.gpu_memory import gpu_memory_limit_mib, limit_gpu_memory
from shards.actor.heap_trim import release_free_heap, weights_read_in_place
from shards.actor.measured_memory import MemoryMarks
from shards.actor.precision import cut_casts, serve_weights_in, variable_bytes
from shards.actor.tflog import import_tensorflow
from shards.bundle.cache import DEFAULT_MAX_BYTES
from shards.bundle.format import (
    Manifest,
    StageSpec,
    allowed_imports,
    load_stage,
    read_manifest,
)
from shards.bundle.shipping import ShippedStage, default_cache_dir, stage_dir_for
from shards.cpu_plan import intra_op_threads
from shards.errors import INPUT_ERRORS, ModelError, one_line
from shards.signature import TensorSpec
from shards.tracing import stage_span

INTERVAL_LOG_SIZE = 256

log = logging.getLogger(__name__)


class _Device(NamedTuple):
    name: str
    intra_op_threads: int
    visible_gpus: int


class ShardActor:
    """One stage's actor; with ``guests``, also the stages it hosts (``Manifest.hosts``: a tied
    table held once, part k's logits run beside its lookup): each guest's model reads the
    host's rows (``shards.split.hold_rows_once``), one copy of them in the process, and is
    called with ``forward(..., stage=index)``, which the pipeline sends in the guests' own Ray
    concurrency group (``shards.split.GUEST_GROUP``) so that neither use waits behind the
    other."""

    def __init__(
        self,
        bundle_dir: str,
        stage_index: int,
        batch_sizes: Sequence[int],
        imports: Sequence[str] = (),
        simulate_device_ms: float | None = None,
        shipped: ShippedStage | None = None,
        stage_cache_dir: str | None = None,
        stage_cache_max_bytes: int = DEFAULT_MAX_BYTES,
        activation_dtype: str | None = None,
        weight_dtype: str | None = None,
        unsafe_deserialization: bool = False,
        gpu_memory_limit: bool = True,
        guests: Sequence[tuple[int, ShippedStage | None]] = (),
    ) -> None:
        self._memory = MemoryMarks()
        sizes = sorted({int(b) for b in batch_sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch_sizes must be integers >= 1, got {list(batch_sizes)!r}")
        if simulate_device_ms is not None and simulate_device_ms < 0:
            raise ValueError(f"simulate_device_ms must be >= 0 or None, got {simulate_device_ms}")
        # A shipped stage brings the driver's manifest: this node may have no bundle at all.
        manifest = Manifest.from_json(shipped.manifest) if shipped else read_manifest(bundle_dir)
        for index in (stage_index, *(g for g, _ in guests)):
            if not 0 <= index < len(manifest.stages):
                raise ValueError(
                    f"stage_index {index} out of range: bundle {bundle_dir!r} has "
                    f"{len(manifest.stages)} stages"
                )
        # Before anything runs: the bundle's own imports only where the operator allowed them.
        modules = allowed_imports(manifest, imports, unsafe_deserialization=unsafe_deserialization)
        self._simulate_s = None if simulate_device_ms is None else simulate_device_ms / 1000.0
        spec = manifest.stages[stage_index]
        # The guests' activations beside the host's plan (their rows are the host's).
        self._planned_peak = manifest.actor_peak_bytes(stage_index) if guests else None
        # Thread pools and device visibility are fixed the first time TensorFlow runs an op, so
        # they are set before the stage is loaded (loading creates variables).
        extra = (self._planned_peak or spec.planned_peak_bytes) - spec.planned_peak_bytes
        self._device = _configure_tensorflow(
            planned_limit_mib(spec, sizes[-1], extra) if gpu_memory_limit else None
        )
        self._memory.mark("tensorflow")
        cache = Path(stage_cache_dir) if stage_cache_dir else default_cache_dir()
        load = _Load(bundle_dir, modules, cache, stage_cache_max_bytes, unsafe_deserialization)
        self._open(manifest, stage_index, shipped, load, activation_dtype, weight_dtype)
        self._guests: dict[int, ShardActor] = {}
        self.held_by: int | None = None
        for index, guest_shipped in guests:
            guest = object.__new__(ShardActor)
            guest._memory, guest._device = self._memory, self._device
            guest._simulate_s, guest._planned_peak = self._simulate_s, None
            guest._guests, guest.held_by = {}, stage_index
            guest._open(
                manifest, index, guest_shipped, load, activation_dtype, weight_dtype, self._model
            )
            self._guests[index] = guest
        # Between loading and the warm-up: what the weights hold, apart from what running adds.
        release_free_heap()
        self._memory.mark("weights")
        for stage in (self, *self._guests.values()):
            stage._ready(sizes)
        # Lean loading: what loading and tracing freed goes back to the system, not the heap.
        release_free_heap()
        self._memory.mark("loaded")

    def _open(
        self,
        manifest: Manifest,
        stage_index: int,
        shipped: ShippedStage | None,
        load: _Load,
        activation_dtype: str | None,
        weight_dtype: str | None,
        host: Any = None,
    ) -> None:
        """Load stage ``stage_index``'s model; a guest's (``host``: the host's model) reads the
        host's rows in place of its own copy."""
        self._spec = manifest.stages[stage_index]
        # Outputs a later stage reads and the driver does not: cast before they leave, cast back
        # to the reader's declared dtype on arrival (``_pick``). Model outputs stay as computed.
        self._cast_out = cut_casts(manifest, stage_index, activation_dtype)
        self._bytes_in = 0
        self._bytes_out = 0
        stage_dir, self._source = stage_dir_for(
            load.bundle_dir, stage_index, shipped, load.cache, load.cache_max_bytes
        )
        self._stage_dir = str(stage_dir)
        with weights_read_in_place():
            self._model = load_stage(
                stage_dir, stage_index, load.modules, unsafe_deserialization=load.unsafe
            )
        # From shapes: get_weights() would copy every weight into numpy once more.
        saved_bytes = variable_bytes(self._model)
        if weight_dtype is not None:
            self._model = serve_weights_in(self._model, weight_dtype)
        self._weight_bytes = variable_bytes(self._model)
        if host is not None:
            from shards.split import hold_rows_once

            # Its own copy of the rows goes: the process holds them once (its weight bytes are
            # what it holds beside the host's).
            self._weight_bytes -= hold_rows_once(self._model, host)
        # A plan made without this weight_dtype counted the weights as saved (float32): the
        # planned peak is compared with what the variables hold now.
        plan = self._spec.memory
        self._planned_weight_cut = (
            saved_bytes - variable_bytes(self._model)
            if plan is None or plan.weight_dtype is None
            else 0
        )

    def _ready(self, sizes: Sequence[int]) -> None:
        """Trace the stage's step and warm it at each batch size."""
        self._trace_count = 0
        self._step = self._build_step()
        self._calls = 0
        self._compute_total_s = 0.0
        self._last_compute_ms = 0.0
        # The server's batching policy predicts from it (serving.batching.cost.RunTimeModel).
        self._compute = ComputeLog(self._spec.index, self._spec.inputs)
        self._intervals: deque[tuple[float, float]] = deque(maxlen=INTERVAL_LOG_SIZE)
        # A dimension unknown in the graph is warmed at the longest a request may bring, as
        # the memory plan counted it; a bundle with no plan (a SavedModel, served whole and
        # never planned) at 1, since the server's --max-sequence-length may be below the default.
        plan = self._spec.memory
        self._length = 1 if plan is None else plan.sequence_length
        for size in sizes:
            self._warm_up(size)

    def _stage(self, stage: int | None) -> ShardActor:
        """This actor's stage ``stage`` (None: its own)."""
        if stage is None or stage == self._spec.index:
            return self
        if stage not in self._guests:
            raise ValueError(
                f"stage {stage} is not run by this actor (stage {self._spec.index}; guests "
                f"{sorted(self._guests)})"
            )
        return self._guests[stage]

    def _warm_up(self, rows: int) -> None:
        try:
            self._run([_zeros(t, rows, self._length) for t in self._spec.inputs])
        except Exception as exc:
            if all(d is not None for t in self._spec.inputs for d in t.shape):
                raise
            # A model whose positions stop short of the length (a fixed position embedding).
            raise ValueError(
                f"stage {self._spec.index} failed its warm-up batch of {rows} row(s) at length "
                f"{self._length} (max_sequence_length): {one_line(exc)}; a model that takes "
                "shorter inputs needs --max-sequence-length at most its longest"
            ) from None

    def _build_step(self) -> Any:
        def traced() -> None:
            # Runs only while tracing: the counter counts traces, not calls.
            self._trace_count += 1

        return stage_step(self._model, self._spec, self._cast_out, traced)

    def _run(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        if self._simulate_s is not None:
            time.sleep(self._simulate_s)
            rows = arrays[0].shape[0] if arrays else 1
            length = self._compute.length_of(arrays) or self._length
            return [
                _zeros(t, rows, length).astype(self._cast_out.get(t.name, t.np_dtype))
                for t in self._spec.outputs
            ]
        import tensorflow as tf

        with tf.device(self._device.name):
            values = self._step(*arrays)
        # numpy, not tf.Tensor: numpy crosses the object store zero-copy.
        return [np.asarray(v) for v in values]

    def forward(
        self, *tensors: np.ndarray, trace: str | None = None, stage: int | None = None
    ) -> Any:
        """One batch: the stage's inputs positionally in ``spec.inputs`` order; its outputs as
        separate returns in ``spec.outputs`` order (call with ``num_returns=len(outputs)``; one
        output is returned bare), so each goes on its own to the stages that read it.

        ``trace``: the batch span's W3C ``traceparent`` where the batch is traced: the stage's
        span is made here, in this process, under it (``shards.tracing``). ``stage``: a guest
        stage's index (None: this actor's own stage)."""
        if stage is not None and stage != self._spec.index:
            return self._stage(stage).forward(*tensors, trace=trace)
        if trace is None:
            return self._forward(tensors)
        first: Any = tensors[0] if tensors else None
        rows = len(first) if getattr(first, "ndim", 0) else 0
        attributes = {
            "shardserve.stage": self._spec.name,
            "shardserve.stage_index": self._spec.index,
            "shardserve.rows": rows,
            "shardserve.device": self._device.name,
        }
        if self._spec.part is not None:
            attributes["shardserve.part"] = self._spec.name
        with stage_span(trace, f"stage {self._spec.name}", attributes):
            return self._forward(tensors)

    def _forward(self, tensors: Sequence[np.ndarray]) -> Any:
        specs = self._spec.inputs
        if len(tensors) != len(specs):
            raise ModelError(
                f"stage {self._spec.index} reads {len(specs)} tensor(s) "
                f"{[t.name for t in specs]}; got {len(tensors)}",
                input_blamed=False,
            )
        self._bytes_in += sum(int(getattr(t, "nbytes", 0)) for t in tensors)
        start = time.time()
        tick = time.perf_counter()
        try:
            out = self._run([_pick(t, spec) for t, spec in zip(tensors, specs, strict=True)])
        except Exception as exc:
            # Raised as TensorFlow's own error, it would be unpickled in the driver, and the
            # front end would import TensorFlow (0.6 GB, seconds of stall) on a poison row.
            log.warning("stage %d failed on a batch", self._spec.index, exc_info=True)
            blamed = type(exc).__name__ in INPUT_ERRORS
            raise ModelError(one_line(exc), input_blamed=blamed) from None
        elapsed = time.perf_counter() - tick
        self._intervals.append((start, time.time()))
        self._calls += 1
        self._compute_total_s += elapsed
        self._last_compute_ms = elapsed * 1000.0
        self._compute.record(tensors, elapsed)
        self._bytes_out += sum(v.nbytes for v in out)
        return out[0] if len(out) == 1 else tuple(out)

    def info(self, stage: int | None = None) -> dict[str, Any]:
        if stage is not None and stage != self._spec.index:
            return self._stage(stage).info()
        import ray

        ctx = ray.get_runtime_context()
        return {
            "stage_index": self._spec.index,
            "stage": self._spec.name,
            "device": self._device.name,
            "loaded_from": self._source,
            "stage_dir": self._stage_dir,
            "weight_bytes": self._weight_bytes,
            "param_bytes": self._spec.param_bytes,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "visible_gpus": self._device.visible_gpus,
            "intra_op_threads": self._device.intra_op_threads,
            "trace_count": self._trace_count,
            "simulated": self._simulate_s is not None,
            "memory": self.memory(),
            # A guest: the stage whose actor (process) runs it and holds its rows; a host: the
            # stages it runs beside its own.
            "held_by": self.held_by,
            "guests": sorted(self._guests),
        }

    def memory(self) -> dict[str, Any]:
        """Measured (RSS now, peak, at the start-up marks; GPU allocator) beside planned. A host's
        weight bytes are the process's (its guests' own beside its own), a guest's its own."""
        planned = self._planned_peak or self._spec.planned_peak_bytes
        weights = self._weight_bytes + sum(g._weight_bytes for g in self._guests.values())
        cut = self._planned_weight_cut + sum(g._planned_weight_cut for g in self._guests.values())
        return self._memory.report(self._device.name, planned - cut, weights)

    def stats(self, stage: int | None = None) -> dict[str, Any]:
        if stage is not None and stage != self._spec.index:
            return self._stage(stage).stats()
        return {
            "stage_index": self._spec.index,
            # The stage's label: "3.1" for part 1 of a layer split at stage 3.
            "stage": self._spec.name,
            "calls": self._calls,
            "compute_seconds_total": self._compute_total_s,
            "last_compute_ms": self._last_compute_ms,
            # compute_by_rows, compute_by_shape, shapes_run (shards.actor.compute_log).
            **self._compute.stats(),
            # What crossed into and out of this stage (each tensor once, as sent).
            "bytes_in_total": self._bytes_in,
            "bytes_out_total": self._bytes_out,
            "intervals": list(self._intervals),
            "memory": self.memory(),
        }


def planned_limit_mib(spec: StageSpec, max_rows: int, beside: int = 0) -> int | None:
    """The GPU memory cap of a stage from its memory plan, its activations scaled up where the
    actor warms batches of more rows than the plan counted; None for a stage never planned.
    ``beside``: what its guests' plans add (their activations)."""
    plan = spec.memory
    if plan is None:
        return None
    extra_rows = max(0, max_rows - plan.plan_batch_rows)
    per_row = plan.activation_bytes // plan.plan_batch_rows if plan.plan_batch_rows else 0
    return gpu_memory_limit_mib(spec.planned_peak_bytes + beside + extra_rows * per_row)


class _Load(NamedTuple):
    """Where an actor's stages load from (its own and its guests')."""

    bundle_dir: str
    modules: Sequence[str]
    cache: Path
    cache_max_bytes: int
    unsafe: bool


def _configure_tensorflow(memory_limit_mib: int | None = None) -> _Device:
    """Pick the device Ray gave this actor and size TensorFlow's thread pools to its CPUs;
    cap its GPU allocator at ``memory_limit_mib`` (None: grow as needed)."""
    import ray

    # The first import of the actor's process: its start-up lines held to the job's level, and
    # TensorFlow's large buffers from malloc, not a pool that keeps them (shards.actor.heap_trim).
    tf = import_tensorflow()
    ray_gpus = ray.get_gpu_ids()
    physical = tf.config.list_physical_devices("GPU")
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    threads = intra_op_threads(cpus)
    # Stages share the machine's cores: TensorFlow's default pool (all cores per process) makes
    # them fight and pipelining gains nothing; one thread per whole CPU Ray granted keeps them
    # apart (a fractional share, several stages per core, gets one). On
    # a GPU the host side (input copies, small ops) still runs on these threads.
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    if ray_gpus and physical:
        # Ray narrowed CUDA_VISIBLE_DEVICES to this actor's GPUs; a cap (or growth) lets
        # fractional shards share one device instead of the first one taking all its memory.
        limit_gpu_memory(tf, physical, memory_limit_mib)
        if len(physical) > 1:
            log.warning(
                "stage actor holds %d GPUs (ids %s) but runs on /GPU:0 only; one stage uses one "
                "device, so set gpus_per_shard <= 1",
                len(physical),
                ray_gpus,
            )
        return _Device("/GPU:0", threads, len(physical))
    if ray_gpus:
        log.warning(
            "Ray gave this stage actor GPU ids %s (CUDA_VISIBLE_DEVICES=%r) but TensorFlow sees "
            "no GPU; the stage runs on the CPU (install shardserve[gpu] and the NVIDIA driver)",
            ray_gpus,
            os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
    limit_gpu_memory(tf, [], memory_limit_mib)
    if physical:
        # An actor without a Ray GPU must not touch the GPUs of the other actors on its node.
        tf.config.set_visible_devices([], "GPU")
    return _Device("/CPU:0", threads, 0)


def stage_step(
    model: Any, spec: StageSpec, cast_out: dict[str, np.dtype[Any]], on_trace: Any = None
) -> Any:
    """The stage's traced call: its outputs in the manifest's order, those in ``cast_out`` cast
    to their 16-bit dtype here, on the stage's device inside the graph, so what is copied to
    the host (``.numpy()``) is already half the bytes."""
    import tensorflow as tf

    signature = [
        tf.TensorSpec(shape=(None, *t.shape), dtype=tf.as_dtype(t.dtype)) for t in spec.inputs
    ]
    single = len(signature) == 1
    names = [t.name for t in spec.outputs]
    casts = {name: tf.as_dtype(dtype) for name, dtype in cast_out.items()}

    def step(*tensors: Any) -> Any:
        if on_trace is not None:
            on_trace()
        result = model(tensors[0] if single else list(tensors), training=False)
        values = _in_order(result, names, spec.index)
        return [
            tf.cast(v, casts[n]) if n in casts else v for v, n in zip(values, names, strict=True)
        ]

    return tf.function(step, input_signature=signature)


def _in_order(result: Any, names: list[str], stage_index: int) -> list[Any]:
    """The stage model's outputs (a dict, a list or one tensor) in the manifest's order."""
    if isinstance(result, dict):
        values = [result[n] for n in names] if set(names) <= set(result) else list(result.values())
    elif isinstance(result, list | tuple):
        values = list(result)
    else:
        values = [result]
    if len(values) != len(names):
        raise RuntimeError(
            f"stage {stage_index} produced {len(values)} outputs; manifest lists {names}"
        )
    return values


def _zeros(spec: TensorSpec, rows: int, length: int) -> np.ndarray:
    """Zeros of ``spec``'s shape, an unknown dimension at ``length``."""
    shape = (rows, *(length if d is None else d for d in spec.shape))
    return np.zeros(shape, dtype=spec.np_dtype)


def _pick(value: Any, spec: TensorSpec) -> np.ndarray:
    # Also casts a reduced-precision activation back to the dtype the stage declares.
    return np.asarray(value, dtype=spec.np_dtype)
