"""The Ray connection: start or join a cluster, read its resources, size what each stage asks.

On a local Ray the workers inherit the driver's working directory and Ray puts it on their
``sys.path``, so a user's ``--import`` module beside the driver imports in the actors with no
runtime_env. When joining a cluster, modules that are files of the driver's machine (not
installed packages) travel to the other nodes through ``runtime_env["py_modules"]``; installed
ones must be installed on every node. Stage files need no shared filesystem: the pipeline ships
them to nodes that lack them (``shards.bundle.shipping``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sysconfig
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
import ray._private.ray_constants as ray_constants

from shards.actor import tflog
from shards.errors import InsufficientResourcesError, one_line, scrub
from shards.sizes import format_size
from shards.tracing import otel_env

log = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
LOOPBACK = "127.0.0.1"
# Ray's switch for its multi-node mode (named for the platforms where it is off by default).
_MULTI_NODE_ENV = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
# Whether this process started its own private local Ray (connect(None)): that one is this
# process's to stop; a joined cluster, or an instance someone else started, is not.
_started_private = False


def connect(
    address: str | None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    imports: Sequence[str] = (),
) -> str:
    """Start a private local Ray (``address=None``) or join one; returns the GCS address.

    ``imports`` are the user's model modules: when joining a cluster, the ones that are local
    files here are uploaded to every node with the job (``runtime_env["py_modules"]``).
    """
    if ray.is_initialized():
        log.info("reusing the Ray instance already initialized in this process")
        return str(ray.get_runtime_context().gcs_address)
    # Ray's driver installs C-level handlers for SIGTERM/SIGINT that end the process at once;
    # put back the Python handlers (uvicorn's graceful shutdown) that were there before.
    saved = _python_signal_handlers()
    try:
        _init(address, num_cpus=num_cpus, num_gpus=num_gpus, imports=imports)
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    return str(ray.get_runtime_context().gcs_address)


def stop_private() -> None:
    """Stop the private local Ray that ``connect(None)`` started in this process, if any.

    Ray stops it at exit, but uvicorn ends a signalled server by raising the signal again, which
    skips exit handlers: Ray's dashboard and runtime-env agents were then left running, orphaned.
    """
    global _started_private
    if _started_private and ray.is_initialized():
        ray.shutdown()
    _started_private = False


def _python_signal_handlers() -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}


def _init(
    address: str | None, *, num_cpus: int | None, num_gpus: int | None, imports: Sequence[str]
) -> None:
    # Quiet unless the user set it (shards.actor.tflog): every worker would log the missing GPU.
    tf_log_level = os.environ.get(tflog.ENV, tflog.QUIET)
    # The OpenTelemetry variables too: a stage actor exports its spans where the server does
    # (``shards.tracing``), on whichever node it runs.
    runtime_env: dict[str, Any] = {"env_vars": {tflog.ENV: tf_log_level, **otel_env()}}
    if address is None:
        _loopback_only()
        # address="local" always starts a new private instance; a bare ray.init() would attach
        # to any cluster already running on this machine.
        ray.init(
            address="local",
            _node_ip_address=LOOPBACK,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            runtime_env=runtime_env,
        )
        global _started_private
        _started_private = True
    else:
        if num_cpus is not None or num_gpus is not None:
            log.warning(
                "num_cpus=%s num_gpus=%s ignored: they size a private local Ray, and address=%r "
                "joins an existing cluster",
                num_cpus,
                num_gpus,
                address,
            )
        modules = local_py_modules(imports)
        if modules:
            log.info("uploading local modules %s to the cluster's nodes (py_modules)", modules)
            runtime_env["py_modules"] = modules
        ray.init(address=address, logging_level=logging.WARNING, runtime_env=runtime_env)


def _loopback_only() -> None:
    """Have the private Ray listen on 127.0.0.1 only: it serves this process alone, and its
    GCS, raylet, object manager and worker ports run code for whoever reaches them. Ray binds
    them to all addresses unless the node's address is the loopback, and on Linux turns a
    loopback ``_node_ip_address`` into the machine's address unless its multi-node mode is off:
    off here (read at import) and in the processes Ray starts (which inherit the variable)."""
    os.environ[_MULTI_NODE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def local_py_modules(imports: Sequence[str]) -> list[str]:
    """The paths of the top-level modules of ``imports`` that are plain files of this machine
    (a ``.py`` file or a package directory), not installed packages: Ray's ``py_modules`` then
    uploads them to every node. Installed and unknown modules are left out (unknown ones fail
    later, where the stage loads, with the module's name)."""
    installed = {
        os.path.realpath(p)
        for key in ("purelib", "platlib", "stdlib", "platstdlib")
        if (p := sysconfig.get_paths().get(key))
    }
    paths: list[str] = []
    for top in dict.fromkeys(name.split(".")[0] for name in imports):
        spec = importlib.util.find_spec(top)
        if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
            continue
        locations = list(spec.submodule_search_locations or [])
        path = locations[0] if len(locations) == 1 else spec.origin
        real = os.path.realpath(path)
        if any(real == root or real.startswith(root + os.sep) for root in installed):
            continue
        if "site-packages" in Path(real).parts or "dist-packages" in Path(real).parts:
            continue
        paths.append(path)
    return paths


def run_bounded(call: Callable[[], object], timeout_s: float, what: str) -> bool:
    """Run ``call`` in a daemon thread for at most ``timeout_s``; False when it did not finish.

    Ray's kill and placement-group calls block on the GCS; on a cluster that went away they can
    wait far longer than a shutdown may take. A daemon thread left behind cannot keep the
    process alive, and errors are logged rather than raised: the caller is cleaning up.
    """

    def target() -> None:
        try:
            call()
        except Exception:
            log.warning("%s failed", what, exc_info=True)

    thread = threading.Thread(target=target, name=f"bounded: {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("%s did not finish within %g s; left it running", what, timeout_s)
        return False
    return True


def cluster_summary() -> dict[str, Any]:
    total = ray.cluster_resources()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return {
        "nodes": len(alive),
        "cpus": float(total.get("CPU", 0.0)),
        "gpus": float(total.get("GPU", 0.0)),
        "resources": {k: v for k, v in total.items() if not k.startswith("node:")},
    }


def pending_placement(groups: Sequence[Any] = ()) -> str | None:
    """What this job's placement groups not yet placed ask for, beside what the cluster has
    free, in one line for ``/readyz``: ``waiting for resources: placement group of 2 x {CPU: 1};
    cluster has CPU 0/2 free``. None when nothing of this job waits (or Ray is not running).
    ``groups`` (Ray ``PlacementGroup``s): only those, e.g. the one of a replica being added."""
    if not ray.is_initialized():
        return None
    # A placement group's id ends with the id of the job that created it.
    job = ray.get_runtime_context().get_job_id()
    ids = {group.id.hex() for group in groups}
    waiting = [
        group
        for group_id, group in ray.util.placement_group_table().items()
        if (group_id in ids if ids else group_id.endswith(job))
        and group.get("state") in ("PENDING", "RESCHEDULING")
    ]
    if not waiting:
        return None
    shapes = Counter(_group_shape(group) for group in waiting)
    asked = "; ".join(
        f"{count} placement groups of {shape}" if count > 1 else f"placement group of {shape}"
        for shape, count in shapes.items()
    )
    keys = sorted({key for group in waiting for b in group["bundles"].values() for key in b})
    total, free = ray.cluster_resources(), ray.available_resources()
    have = ", ".join(
        f"{k} {resource_amount(k, free.get(k, 0.0))}/{resource_amount(k, total.get(k, 0.0))} free"
        for k in keys
    )
    return scrub(f"waiting for resources: {asked}; cluster has {have}")


def _group_shape(group: dict[str, Any]) -> str:
    bundles = Counter(
        "{" + ", ".join(f"{k}: {resource_amount(k, v)}" for k, v in sorted(bundle.items())) + "}"
        for bundle in group["bundles"].values()
    )
    shape = " + ".join(f"{n} x {b}" if n > 1 else b for b, n in bundles.items())
    strategy = group.get("strategy", "PACK")
    return shape if strategy == "PACK" else f"{shape} ({strategy})"


def cluster_has_gpus() -> bool:
    return float(ray.cluster_resources().get("GPU", 0.0)) > 0


# How long the driver waits for a GPU to say how much memory it has: a GPU node that does not
# answer in time leaves the budget unset, as on a machine without GPUs.
GPU_MEMORY_TIMEOUT_S = 30.0


def _gpu_memory_mib() -> int | None:
    """The total memory of the GPU Ray gave this task, in MiB, by ``nvidia-smi``; None where
    there is none to ask."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    ids = ray.get_gpu_ids()
    query = [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    if ids:
        query.append(f"--id={ids[0]}")
    done = subprocess.run(query, capture_output=True, text=True, timeout=10, check=False)
    lines = [ln.strip() for ln in done.stdout.splitlines() if ln.strip()]
    return int(float(lines[0])) if done.returncode == 0 and lines else None


def gpu_memory_bytes(timeout_s: float = GPU_MEMORY_TIMEOUT_S) -> int | None:
    """The memory of one of the cluster's GPUs (asked of a task holding one), or None where no
    GPU answers in time: where it cannot be asked, ``--gpu-memory-bytes`` gives it."""
    task = ray.remote(num_gpus=1, num_cpus=0)(_gpu_memory_mib)
    ref = task.remote()
    try:
        mib = ray.get(ref, timeout=timeout_s)
    except Exception as exc:
        ray.cancel(ref, force=True)
        log.warning("no GPU said how much memory it has (%s): no default budget", one_line(exc))
        return None
    if mib is None:
        log.warning("the GPU task found no nvidia-smi: no default budget (--gpu-memory-bytes)")
        return None
    return int(mib) * 1024**2


def check_cluster_fits(
    bundles: Sequence[dict[str, float]],
    replicas: int,
    strategy: str,
    memory_fix: str | None = None,
) -> None:
    """Raise InsufficientResourcesError where ``replicas`` placement groups of ``bundles`` can
    never be placed on the cluster as it is (a placement group would wait for them forever).
    ``memory_fix``: what the user can do when the memory plan is short (a partitioned model's
    by default)."""
    total = ray.cluster_resources()
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + amount * replicas
    short = {k: v for k, v in need.items() if total.get(k, 0.0) + 1e-9 < v}
    if short:
        wanted = ", ".join(f"{k}={resource_amount(k, v)}" for k, v in sorted(short.items()))
        have = ", ".join(f"{k}={resource_amount(k, total.get(k, 0.0))}" for k in sorted(short))
        free = ray.available_resources()
        now = ", ".join(f"{k}={resource_amount(k, free.get(k, 0.0))}" for k in sorted(short))
        per_stage = [{k: resource_amount(k, v) for k, v in b.items()} for b in bundles]
        raise InsufficientResourcesError(
            f"the pipeline needs {wanted} ({replicas} replica(s) x {len(bundles)} stage(s), "
            f"per stage {per_stage}) but the cluster has only {have} ({now} free); "
            f"{_fix(short, memory_fix)}"
        )
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    for index, bundle in enumerate(bundles):
        if not any(bundle_fits(bundle, node) for node in nodes):
            raise InsufficientResourcesError(
                f"stage {index} asks for {bundle} on one node; no node has that much "
                f"(nodes: {[_public(n) for n in nodes]})"
            )
    if strategy == "STRICT_SPREAD" and len(nodes) < len(bundles):
        raise InsufficientResourcesError(
            f"placement_strategy STRICT_SPREAD needs {len(bundles)} nodes (one per stage); "
            f"the cluster has {len(nodes)}"
        )
    if strategy == "STRICT_PACK":
        whole = {k: sum(b.get(k, 0.0) for b in bundles) for k in need}
        if not any(bundle_fits(whole, node) for node in nodes):
            raise InsufficientResourcesError(
                f"placement_strategy STRICT_PACK needs {whole} on one node; no node has that much"
            )


def placement_resources(
    num_stages: int,
    cpus: float,
    gpus: float,
    extra: tuple[dict[str, float], ...] = (),
    memory: Sequence[int] = (),
) -> list[dict[str, float]]:
    """What each stage asks of its placement group (Ray calls each entry a bundle): its CPUs,
    GPUs and custom resources, and ``memory[i]`` bytes of Ray's memory resource (stage i's
    planned peak on a CPU stage: Ray then places a model only where its plan fits beside the
    others', and ``pending_placement`` says so)."""
    if extra and len(extra) != num_stages:
        raise ValueError(
            f"stage_resources has {len(extra)} entries; the bundle has {num_stages} stages"
        )
    bundles = []
    for index in range(num_stages):
        bundle = {"CPU": float(cpus), "GPU": float(gpus), **(extra[index] if extra else {})}
        if memory:
            bundle["memory"] = float(memory[index])
        bundle = {k: float(v) for k, v in bundle.items() if v > 0}
        if not bundle:
            raise ValueError(f"stage {index} asks for no resources; set cpus_per_shard > 0")
        bundles.append(bundle)
    return bundles


def resource_amount(key: str, value: float) -> str:
    """A resource amount as people read it: bytes for Ray's memory resources."""
    return format_size(int(value)) if "memory" in key else f"{value:g}"


def _fix(short: dict[str, float], memory_fix: str | None = None) -> str:
    if "memory" in short and memory_fix is not None:
        return memory_fix
    if "memory" in short:
        return (
            "the memory plan of its stages (weights + activations at max_batch_size + overhead) "
            "is more than the cluster's memory: cut it into more stages (stages / "
            "max_stage_bytes), lower max_batch_size or replicas, use --weight-dtype, or unload "
            "another model"
        )
    return "lower gpus_per_shard / cpus_per_shard / replicas or add nodes"


def bundle_fits(bundle: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def _public(node: dict[str, float]) -> dict[str, float]:
    return {
        k: v
        for k, v in node.items()
        if k in ("CPU", "GPU")
        or not k.startswith(("node:", "memory", "object_store_memory", "accelerator_type"))
    }
