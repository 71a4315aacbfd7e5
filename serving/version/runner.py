"""The one narrow interface between the front end and the model, and how the real one is built.

The app needs only ``ModelRunner``: a signature, its stages and replicas, ``run_batch``, health
and stage stats. The real runner is a ``shards.pipeline.replica_set.ReplicaSet`` of Ray shard
actors; tests pass a fake. Nothing here imports TensorFlow: the model is resolved to a bundle
inside a Ray task, and the signature comes from the bundle manifest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from weakref import WeakKeyDictionary

import numpy as np

from serving.settings.config import Settings
from serving.settings.lengths import served_max_length
from shards.cpu_plan import Pipeline, cpus_per_stage, machine_cores, scheduling_cpus
from shards.pipeline.health import Health
from shards.signature import ModelSignature

if TYPE_CHECKING:
    from serving.generation.engine import Generator
    from shards.pipeline.options import PipelineOptions

log = logging.getLogger("shardserve")
# The logical CPUs of the private local Ray this process starts (``plan_private_ray``); None:
# sized to the first model loaded. Process-wide by nature, not a version's: a process starts one
# private Ray (``ray.init`` connects the process), sized once for every version it is to serve.
_private_ray_cpus: int | None = None
# The cached bundle each runner ``build_runner`` made serves (marked as served by this process
# while the runner lives: ``release_bundle``).
_bundles: WeakKeyDictionary[object, Path] = WeakKeyDictionary()
# Versions load side by side, each starting Ray on its own thread: one starts it, the others
# join it (two ``ray.init`` at once would both try to start one).
_connect_lock = threading.Lock()


@runtime_checkable
class ModelRunner(Protocol):
    """What the server uses of a model: ``run_batch`` raises ``shards.errors.RunError`` (or a
    ``serving.errors.ShardServeError``) with a one-line reason when a batch fails."""

    signature: ModelSignature
    num_stages: int
    replicas: int
    on_gpu: bool  # the stages run on GPUs: batches are padded to bucketed sizes

    async def run_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def health(self) -> Health: ...

    async def stats(self) -> list[dict[str, Any]]: ...

    async def close(self) -> None: ...


def pipeline_depth(runner: object) -> int:
    """Stages one after the other in one replica: a split layer's parts run the same batch side by
    side and hold one batch between them (the manifest's ``depth``); a runner without parts: its
    stages. Every limit sized by the pipeline (in-flight batches, queue rows, the auto wait's
    depth) reads this, at start-up, after a scale step, in the OpenAPI document and on the admin
    route alike."""
    return int(getattr(runner, "pipeline_depth", getattr(runner, "num_stages", 1)))


@runtime_checkable
class ElasticRunner(Protocol):
    """A runner whose replica count can change (``shards.pipeline.replica_set.ReplicaSet``): the
    scale steps (``serving.elastic.steps``, taken by the reconciler) add and remove replicas one
    at a time; a runner without these methods is never scaled.

    ``add_replica``: True once the new replica serves (after its warm-up); False when it was
    given up (pending past ``pending_timeout_s``, or it failed to start). ``remove_replica``:
    takes one out of the rotation (a pending or starting one first, then an unhealthy one),
    lets its in-flight batches finish within ``drain_timeout_s``, then ends its actors; False
    when none could go (never the last one)."""

    async def add_replica(self, pending_timeout_s: float) -> bool: ...

    async def remove_replica(self, drain_timeout_s: float) -> bool: ...

    def health(self) -> Health: ...


# Builds a model's runner from the settings (``build_runner``; tests pass their fakes'): a
# generating model's is a ``Generator`` (its scheduler over its replicas) instead.
RunnerFactory = Callable[[Settings], Awaitable["ModelRunner | Generator"]]


async def build_runner(settings: Settings) -> ModelRunner | Generator:
    """Connect to (or start) Ray, resolve the model to a bundle, start and warm the pipelines;
    for a generating model (a keras_hub CausalLM preset directory), its generation replicas and
    their scheduler (``build_generator``)."""
    from shards.generation import is_generating_model

    # A preset directory generates; a .keras file of a CausalLM keeps serving :predict (its
    # generating alongside is not wired yet).
    if Path(settings.model).is_dir() and is_generating_model(settings.model):
        return await build_generator(settings)
    # Importing Ray, starting it and asking the cluster block for seconds (a private Ray takes
    # ~5 s to start on 2 cores): on a thread, so that /healthz and /readyz answer meanwhile.
    saved = _signal_handlers()
    try:
        overhead = await asyncio.to_thread(_start_ray, settings)
    finally:
        # Ray's driver puts C-level SIGTERM/SIGINT handlers in (a stack dump, then the old
        # handler); ``runtime.connect`` puts uvicorn's back only when on the main thread.
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    from shards.pipeline.replica_set import ReplicaSet
    from shards.source.remote import resolve_bundle_remote
    from shards.source.resolve import ResolveOptions

    budget = await asyncio.to_thread(device_budget, settings)
    resolve = ResolveOptions(
        stages=settings.stages,
        max_stage_bytes=budget,
        imports=tuple(settings.imports),
        cache_dir=settings.cache_dir,
        plan_batch_rows=settings.max_batch_size,
        device_overhead_bytes=overhead,
        unsafe_deserialization=settings.unsafe_deserialization,
        weight_dtype=settings.weight_dtype,
        cache_max_bytes=settings.cache_max_bytes,
        max_sequence_length=settings.max_sequence_length,
        lookup_combine=settings.lookup_combine,
    )
    bundle = await resolve_bundle_remote(settings.model, resolve)
    log.info("model %r -> bundle %s", settings.model, bundle)
    try:
        await asyncio.to_thread(check_driver_join, settings, bundle)
    except BaseException:
        _release(bundle)
        raise
    options = pipeline_options(settings)
    copies = await asyncio.to_thread(stage_replicas, settings, bundle)
    if copies > 1:
        options = dataclasses.replace(options, replicas=copies, cpus_per_shard=1.0)
        log.info(
            "model %r: its one stage runs as %d single-threaded replicas instead of one actor "
            "with %d TensorFlow threads (--stage-cores replicas)",
            settings.model, copies, copies,
        )  # fmt: skip
    try:
        group: Any = await ReplicaSet.create(bundle, options)
    except BaseException:
        _release(bundle)
        raise
    _bundles[group] = bundle
    return group  # type: ignore[no-any-return]


def check_driver_join(settings: Settings, bundle: Path) -> None:
    """Refuse (``shards.errors.PlanError``) a bundle whose outputs joined in the front end
    (``shards.split``) would be over ``driver_join_max_bytes`` at the largest
    batch this version sends, at its served sequence length."""
    from shards.bundle.format import read_manifest
    from shards.split import check_join_budget

    manifest = read_manifest(bundle)
    if not manifest.combines:
        return
    check_join_budget(
        manifest.combines,
        manifest.signature,
        max(settings.padded_sizes()),
        served_max_length(settings.max_sequence_length, manifest.signature),
        settings.driver_join_max_bytes,
    )


def release_bundle(runner: object) -> None:
    """The runner's cached bundle is no longer served by it (its version retired or unloaded):
    this process's mark on it goes (``shards.bundle.cache.release``), so a prune may remove it
    once no other version serves it. Nothing for a runner ``build_runner`` did not make, or a
    second time."""
    bundle = _bundles.pop(runner, None)
    if bundle is not None:
        _release(bundle)


def _release(bundle: Path) -> None:
    from shards.bundle import cache

    cache.release(bundle)


def _start_ray(settings: Settings) -> int:
    """Connect to (or start) Ray; the device overhead the memory plan counts (it asks the
    cluster for GPUs)."""
    from shards import cluster as runtime

    logging.getLogger("ray._private.worker").addFilter(_not_main_thread_note)
    cpus = None
    if settings.ray_address is None:
        cpus = _private_ray_cpus or private_ray_cpus([settings])
    with _connect_lock:
        address = runtime.connect(
            settings.ray_address, num_cpus=cpus, imports=tuple(settings.imports)
        )
    log.info("ray: %s %s", address, runtime.cluster_summary())
    return device_overhead(settings)


def plan_private_ray(versions: Iterable[Settings]) -> int:
    """Size the private local Ray this process will start for every model version it is to
    serve (their settings), before the first load starts it: see ``private_ray_cpus``. Nothing
    changes for a server that joins a cluster (``ray_address``) or a Ray already running."""
    global _private_ray_cpus
    _private_ray_cpus = private_ray_cpus(versions)
    return _private_ray_cpus


def private_ray_cpus(versions: Iterable[Settings]) -> int:
    """The logical CPUs a private local Ray needs so that every version's stage actors get
    their CPUs at once, with room for one more (``shards.cpu_plan.scheduling_cpus``): Ray's
    count is a scheduling count there, and the actors' TensorFlow threads share the real cores."""
    return scheduling_cpus(_pipeline(settings) for settings in versions)


def stage_replicas(settings: Settings, bundle: Path) -> int:
    """How many single-threaded replicas serve ``bundle`` (``shards.cpu_plan.stage_copies``),
    where the choice is the server's: ``stage_cores`` "replicas", a private Ray, and no replica
    count, replica bounds, CPUs per shard or stage budget given (a model that needed its stages
    to fit a budget is not copied); else 1 (the version's own replicas)."""
    from shards.bundle.format import read_manifest
    from shards.cpu_plan import available_memory, stage_copies

    given = settings.model_fields_set & _COUNTS_GIVEN
    if settings.stage_cores != "replicas" or settings.ray_address is not None or given:
        return 1
    if settings.max_stage_bytes:
        return 1
    stages = read_manifest(bundle).stages
    peak = stages[0].planned_peak_bytes if stages else 0
    return stage_copies(len(stages), peak, machine_cores(), available_memory())


# Settings that, given, say how the cores or the replicas are used: the server does not choose.
_COUNTS_GIVEN = frozenset(
    {"replicas", "min_replicas", "max_replicas", "cpus_per_shard", "max_stage_bytes"}
)


def _pipeline(settings: Settings) -> Pipeline:
    # Reserved for the most replicas the version may scale to: a replica added later must find
    # its CPUs in the private Ray's count.
    return (estimated_stages(settings), settings.replica_bounds()[1], settings.cpus_per_shard)


def _cpus_per_shard(settings: Settings) -> float | None:
    """The setting, else (an elastic version on a private local Ray) each stage actor's share of
    the cores among the stage actors of its most replicas, so that the TensorFlow threads of
    every replica it may scale to fit the machine; else unset (placement decides)."""
    low, high = settings.replica_bounds()
    if settings.cpus_per_shard is not None or settings.ray_address is not None or low == high:
        return settings.cpus_per_shard
    return cpus_per_stage(None, private_ray=True, actors=estimated_stages(settings) * high)


def estimated_stages(settings: Settings) -> int:
    """How many stages the model will be cut into, before it is: ``stages``, one per device
    budget, a bundle's own, else the model file over a single budget (its weights), else 1."""
    if settings.stages is not None:
        return settings.stages
    budgets = settings.max_stage_bytes or []
    if len(budgets) > 1:
        return len(budgets)
    path = Path(settings.model)
    try:
        if (path / "manifest.json").is_file():
            return max(1, len(json.loads((path / "manifest.json").read_text())["stages"]))
        if budgets and path.is_file():
            return max(1, math.ceil(path.stat().st_size / budgets[0]))
    except (OSError, ValueError, KeyError, TypeError):
        log.debug("could not estimate the stages of %s", path, exc_info=True)
    return 1


def _signal_handlers() -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    return {s: h for s, h in handlers.items() if h is not None}


def _not_main_thread_note(record: logging.LogRecord) -> bool:
    """Drop Ray's warning that it set no SIGTERM handler off the main thread: the server keeps
    its own on purpose (``build_runner``)."""
    return "not the main thread" not in record.getMessage()


def device_overhead(settings: Settings) -> int:
    """The per-device overhead the memory plan counts: the setting, else the default for the
    device the stages will run on (a GPU when they get one)."""
    from shards import cluster as runtime
    from shards.partition.memory_plan import default_overhead

    if settings.device_overhead_bytes is not None:
        return settings.device_overhead_bytes
    gpus = settings.gpus_per_shard
    return default_overhead(gpu=runtime.cluster_has_gpus() if gpus is None else gpus > 0)


def device_budget(settings: Settings) -> list[int] | None:
    """The budget the model is cut to: ``max_stage_bytes``; else, where the stages get GPUs and
    no ``stages`` is given, one GPU's memory (``gpu_memory_bytes``, else asked of a GPU) times
    the share of it each stage gets, so that a layer larger than a GPU is split rather than run
    out of memory; else none (a CPU's memory is the machine's, shared by every stage)."""
    from shards import cluster as runtime

    if settings.max_stage_bytes is not None or settings.stages is not None:
        return settings.max_stage_bytes
    gpus = settings.gpus_per_shard
    if gpus == 0 or not runtime.cluster_has_gpus():
        return None
    memory = settings.gpu_memory_bytes or runtime.gpu_memory_bytes()
    if memory is None:
        return None
    share = 1.0 if gpus is None else min(gpus, 1.0)
    log.info("no max_stage_bytes: each stage's budget is its GPU's memory (%d bytes)", memory)
    return [int(memory * share)]


def pipeline_options(settings: Settings) -> PipelineOptions:
    """How the shard actors are started, from the server's settings."""
    from shards.pipeline.options import PipelineOptions

    return PipelineOptions(
        replicas=settings.replicas,
        gpus_per_shard=settings.gpus_per_shard,
        cpus_per_shard=_cpus_per_shard(settings),
        private_ray=settings.ray_address is None,
        placement_strategy=settings.placement_strategy,
        stage_resources=tuple(settings.stage_resources),
        batch_sizes=settings.padded_sizes(),
        imports=tuple(settings.imports),
        simulate_device_ms=settings.simulate_device_ms,
        ship_stages=settings.ship_stages,
        stage_cache_max_bytes=settings.cache_max_bytes,
        compiled_graph=settings.compiled_graph,
        activation_dtype=settings.activation_dtype,
        weight_dtype=settings.weight_dtype,
        unsafe_deserialization=settings.unsafe_deserialization,
        gpu_memory_limit=settings.gpu_memory_limit,
        max_inflight_per_replica=settings.max_inflight_batches,
        max_restarts=settings.shard_max_restarts,
        # A replica's placement and warm-up (at start and on every rebuild) get the whole load
        # budget: a shorter inner limit would end a slow load before its own timeout names why.
        ready_timeout_s=settings.load_timeout_s,
        batch_hard_timeout_s=None
        if settings.batch_hard_timeout_ms is None
        else settings.batch_hard_timeout_ms / 1000.0,
    )


async def release_cluster(timeout_s: float) -> None:
    """Stop the private local Ray this process started (``shards.cluster.stop_private``) within
    ``timeout_s``; nothing when this process never started one (a fake runner, a cluster)."""
    cluster = sys.modules.get("shards.cluster")
    if cluster is None:
        return
    try:
        await asyncio.wait_for(asyncio.to_thread(cluster.stop_private), max(timeout_s, 0.1))
    except TimeoutError:
        log.warning("the private Ray did not stop within the stop budget; exiting without it")


async def build_generator(settings: Settings) -> Generator:
    """A generating model: its replicas' stage actors (``shards.generation``), each holding its
    decoder blocks and KV cache, and the scheduler over them (``serving.generation``)."""
    from serving.generation.engine import Generator, scheduler_settings
    from serving.settings.config import ConfigError
    from shards.generation import start_generation_replicas

    if settings.compiled_graph:
        raise ConfigError(
            f"--compiled-graph is not served for a generating model ({settings.model}): its "
            "steps run on plain stage actors; leave the flag out"
        )
    saved = _signal_handlers()
    try:
        await asyncio.to_thread(_start_ray, settings)
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    replicas = await start_generation_replicas(
        settings.model,
        stages=settings.stages,
        kv_slots=settings.kv_slots,
        max_sequence_length=settings.max_sequence_length,
        head_parts=settings.head_parts,
        gpu_memory_limit=settings.gpu_memory_limit,
        replicas=settings.replica_bounds()[0],
        num_gpus_per_stage=settings.gpus_per_shard or 0.0,
        num_cpus_per_stage=settings.cpus_per_shard or 1.0,
        max_restarts=settings.shard_max_restarts,
        ready_timeout_s=settings.load_timeout_s,
        stage_cache_dir=str(settings.cache_dir),
        step_timeout_s=None
        if settings.batch_hard_timeout_ms is None
        else settings.batch_hard_timeout_ms / 1000.0,
    )
    return Generator(replicas, scheduler_settings(settings))
