"""How the shard actors of a model are started and kept: the options of a ``ReplicaSet``."""

from __future__ import annotations

from dataclasses import dataclass

from shards.bundle.cache import DEFAULT_MAX_BYTES
from shards.cluster import PLACEMENT_STRATEGIES
from shards.dtypes import check_reduced


@dataclass(frozen=True)
class PipelineOptions:
    replicas: int = 1
    gpus_per_shard: float | None = None
    # None: split the private local Ray's CPUs between all stage actors (see
    # ``runtime.shared_cpus``), or 1 each when joined to a cluster.
    cpus_per_shard: float | None = 1.0
    # True when this process started its own local Ray: its CPU count is this machine's cores,
    # a scheduling count only, so any number of stages may share them.
    private_ray: bool = False
    placement_strategy: str = "PACK"
    stage_resources: tuple[dict[str, float], ...] = ()
    batch_sizes: tuple[int, ...] = (1,)
    imports: tuple[str, ...] = ()
    # Ray restarts a dead stage actor this many times before its replica is rebuilt.
    max_restarts: int = 3
    simulate_device_ms: float | None = None
    ready_timeout_s: float = 300.0
    # None: ship the stage files placed on nodes other than the driver's; True: ship every
    # stage (an actor still loads its node's copy when it matches); False: never ship.
    ship_stages: bool | None = None
    stage_cache_dir: str | None = None
    # The stage cache on each node is pruned to this after an actor takes its entry.
    stage_cache_max_bytes: int = DEFAULT_MAX_BYTES
    # Run each replica as a Ray compiled graph (shards.pipeline.compiled): less latency per batch, a
    # spinning core per stage actor; a dead actor means rebuilding its replica.
    compiled_graph: bool = False
    # The compiled graph's capacity per replica; None: stages + 1 (the batcher's default share).
    # More batches than this wait for a free place rather than fail.
    max_inflight_per_replica: int | None = None
    # The watchdog: a batch running longer (timed from when its first stage starts it) is
    # abandoned and its replica's stages restarted. None: 10 x the p99 of recent batches of its
    # size, at least 5 s (a size not seen 20 times yet: scaled from the largest size that was;
    # 60 s until one was).
    batch_hard_timeout_s: float | None = None
    # Float tensors crossing a cut travel in this dtype ("bfloat16", "float16"); None: as
    # computed. Model outputs are never cast.
    activation_dtype: str | None = None
    # Stage weights held in this dtype, computing in float32; None: as saved.
    weight_dtype: str | None = None
    # Load stages holding Lambda layers or other Python code (Keras safe_mode off).
    unsafe_deserialization: bool = False
    # A stage actor on a GPU caps TensorFlow's allocator at its planned peak x a margin
    # (shards.actor.gpu_memory); False: memory growth, no cap.
    gpu_memory_limit: bool = True

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.gpus_per_shard is not None and self.gpus_per_shard < 0:
            raise ValueError(f"gpus_per_shard must be >= 0 or None, got {self.gpus_per_shard}")
        if self.cpus_per_shard is not None and self.cpus_per_shard < 0:
            raise ValueError(f"cpus_per_shard must be >= 0, got {self.cpus_per_shard}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                f"got {self.placement_strategy!r}"
            )
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be integers >= 1, got {self.batch_sizes}")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")
        if self.max_inflight_per_replica is not None and self.max_inflight_per_replica < 1:
            raise ValueError(
                f"max_inflight_per_replica must be >= 1, got {self.max_inflight_per_replica}"
            )
        check_reduced(self.activation_dtype, "activation_dtype")
        check_reduced(self.weight_dtype, "weight_dtype")
        if self.stage_cache_max_bytes < 0:
            raise ValueError(
                f"stage_cache_max_bytes must be >= 0, got {self.stage_cache_max_bytes}"
            )
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.batch_hard_timeout_s is not None and self.batch_hard_timeout_s <= 0:
            raise ValueError(f"batch_hard_timeout_s must be > 0, got {self.batch_hard_timeout_s}")
