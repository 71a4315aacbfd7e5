"""Every knob of the server in one typed settings object.

Sources, strongest first: command-line flags (``--max-batch-size``), environment variables
(``SHARDSERVE_MAX_BATCH_SIZE``), a TOML file (``--config``), then the defaults below.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings.exceptions import SettingsError

from serving.settings.elastic import ScalingSettings
from serving.settings.generation import GenerationSettings
from serving.settings.grpc_limits import GrpcSettings
from serving.settings.lengths import MAX_LENGTH_LIMIT, LengthSettings
from serving.settings.repository import RepositorySettings
from serving.settings.sources import ConfigError, TomlSource, format_validation_error, split_csv
from serving.settings.tls import TlsSettings
from serving.settings.waits import AUTO, WaitMs, is_auto, parse_wait_ms
from shards.partition.memory_plan import DEFAULT_MAX_SEQUENCE_LENGTH, parse_budgets, parse_bytes
from shards.split.lookup import DEFAULT_LOOKUP_COMBINE, LookupCombine

__all__ = ["ConfigError", "Settings", "default_queue_rows", "load_settings", "padded_batch_sizes"]

MiB = 1024 * 1024
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
ReducedDtype = Literal["float32", "bfloat16", "float16"]

_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "shardserve_config_file", default=None
)


# The length-padding fields: LengthSettings; the model repository's: RepositorySettings; the
# gRPC calls' limits: GrpcSettings; TLS's: TlsSettings; a generating model's: GenerationSettings.
class Settings(
    BaseSettings,
    LengthSettings,
    RepositorySettings,
    ScalingSettings,
    GrpcSettings,
    TlsSettings,
    GenerationSettings,
):
    model_config = SettingsConfigDict(
        env_prefix="SHARDSERVE_", extra="forbid", validate_default=True
    )

    # --- HTTP
    host: str = Field("127.0.0.1", description="Address to bind (0.0.0.0 to serve the network).")
    port: int = Field(8000, ge=1, le=65535, description="TCP port of the HTTP server.")
    grpc_port: int = Field(
        8001,
        ge=0,
        le=65535,
        description="TCP port of the gRPC server (Open Inference Protocol); 0 = no gRPC.",
    )
    max_body_bytes: int = Field(16 * MiB, ge=1024, description="Largest request body; 413 above.")
    body_read_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Longest a request's head may take to arrive (from its first byte, or from "
        "the connection's start), and its body (from when its handler starts reading it); past "
        "it 408 and the connection is closed (a slow client holds no connection, queue room, "
        "buffer or drain for longer); a gRPC call's message, from the call's start "
        "(DEADLINE_EXCEEDED).",
    )
    max_connections: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="Open HTTP connections (sockets, idle ones included) at once; one more is "
        "answered 503 (Retry-After) as it connects, and closed.",
    )
    admin_token: SecretStr | None = Field(
        None, description="Bearer token for /admin routes; unset = admin routes off."
    )
    admin_token_file: Path | None = Field(
        None,
        description="File holding the admin token (a mounted Kubernetes secret), instead of "
        "admin_token: off the command line and out of the environment.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of the server; TensorFlow's own C++ log only at debug."
    )
    stop_timeout_s: float = Field(
        25.0,
        gt=0,
        le=3600,
        description="Longest a stop (SIGTERM) takes: requests still held near its end get 503, "
        "then the process exits; keep it below the orchestrator's grace period "
        "(terminationGracePeriodSeconds, docker stop -t).",
    )

    # --- observability (serving.telemetry)
    tracing: bool | None = Field(
        None,
        description="Export OpenTelemetry traces over OTLP; unset = on where an "
        "OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set, as for any OpenTelemetry service; "
        "OTEL_SDK_DISABLED=true wins. The OTEL_* variables configure the rest.",
    )
    otlp_endpoint: str | None = Field(
        None,
        description="Where traces go (an OTLP/HTTP URL such as http://collector:4318, or "
        "with OTEL_EXPORTER_OTLP_PROTOCOL=grpc a gRPC one, http://collector:4317); turns "
        "tracing on; unset = the OTEL_EXPORTER_OTLP_* variables'.",
    )
    trace_client_sampled_per_s: float = Field(
        10.0,
        ge=0,
        le=1_000_000,
        description="A client's traceparent with the sampled flag is honoured this many times "
        "a second at most (a trace recorded in the client's trace); past it, and at 0, such a "
        "request starts a trace of the server's own, linked to the client's, that the server's "
        "sampler (OTEL_TRACES_SAMPLER) decides: a client cannot force full tracing's cost.",
    )
    access_log: Literal["json", "text", "off"] = Field(
        "off",
        description="One line per request on stdout (logger shardserve.access): json for log "
        "pipelines, text for people; its fields are in docs/observability.md (Access log).",
    )
    access_log_probes: bool = Field(
        False,
        description="Log the health and readiness probes and the /metrics scrapes that answer "
        "2xx too (a failed one is always logged); off: they would be most of the lines.",
    )

    # --- the model
    model: str = Field(
        "demo-mlp", description="A .keras file, a bundle directory, or a demo model name."
    )
    model_name: str | None = Field(
        None, description="Name served under /v1/models/{name}; default: from --model."
    )
    stages: int | None = Field(
        None, ge=1, le=64, description="Cut the model into this many balanced stages."
    )
    max_stage_bytes: Annotated[list[int] | None, NoDecode] = Field(
        None,
        description="Memory budget per device (weights + activations at max_batch_size + "
        "overhead), e.g. 16GiB: the fewest stages that fit; 16GiB,40GiB: stage i on device i.",
    )
    device_overhead_bytes: int | None = Field(
        None,
        description="A device's own memory before any weight (e.g. 1GiB); unset = 1 GiB on a "
        "GPU, 700 MiB on a CPU.",
    )
    gpu_memory_bytes: int | None = Field(
        None,
        description="Memory of one GPU (e.g. 80GiB): the device budget where the cluster has "
        "GPUs and neither max_stage_bytes nor stages is given; unset = asked of a GPU "
        "(nvidia-smi).",
    )
    max_sequence_length: int | None = Field(
        None,
        ge=1,
        le=MAX_LENGTH_LIMIT,
        description="Longest length of an input dimension the model leaves unknown (tokens): "
        "the memory plan and the warm-up batch use it; a longer request is refused (400). "
        f"Unset = the model's own bound (a position embedding's rows), else "
        f"{DEFAULT_MAX_SEQUENCE_LENGTH}; one over the model's bound is refused at start.",
    )
    imports: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Modules imported before loading a stage (custom Keras layers).",
    )
    unsafe_deserialization: bool = Field(
        False,
        description="Load models and stages holding Lambda layers or other Python code (Keras "
        "safe_mode off), and import the modules a bundle's manifest names without --import; "
        "only for models from a source you trust.",
    )
    cache_dir: Path = Field(
        Path.home() / ".cache" / "shardserve",
        description="Where partitioned bundles of .keras files and demo models are kept.",
    )
    cache_max_bytes: int = Field(
        20 * 1024 * MiB,
        ge=0,
        description="Size the bundle cache is pruned to after each load (e.g. 20GiB), least "
        "recently used bundles first; a bundle being served is never removed. The stage cache "
        "of every node that gets shipped stages is pruned to it too, as each actor loads.",
    )

    # --- Ray and placement
    ray_address: str | None = Field(
        None, description="auto or HOST:PORT of a Ray cluster; unset = a private local Ray."
    )
    replicas: int = Field(1, ge=1, le=64, description="Pipelines (data parallel).")
    gpus_per_shard: float | None = Field(
        None, ge=0, le=8, description="GPUs per shard actor; unset = 1 if the cluster has GPUs."
    )
    cpus_per_shard: float | None = Field(
        None,
        gt=0,
        le=256,
        description="CPUs per shard actor (whole ones are its TensorFlow threads); unset = its "
        "share of the cores among the model's stage actors, in whole threads (at least 1), on a "
        "private local Ray, 1 on a cluster.",
    )
    stage_cores: Literal["replicas", "threads"] = Field(
        "threads",
        description="On a private local Ray, a model of one stage: one actor with a TensorFlow "
        "thread per core (threads, the lower latency), or, where its copies fit in half the free "
        "memory, one single-threaded replica per core (replicas: +4% req/s for a light model "
        "under load, +25% c=1 latency for a heavy one); not when replicas, CPUs per shard or a "
        "stage budget are given (docs/tuning.md).",
    )
    placement_strategy: PlacementStrategy = Field(
        "PACK", description="Placement group strategy of a pipeline's shard actors."
    )
    stage_resources: list[dict[str, float]] = Field(
        default_factory=list,
        description='Extra Ray resources per stage, JSON: [{"node_a": 1}, {"node_b": 1}].',
    )
    ship_stages: bool | None = Field(
        None,
        description="Send stage files to shard actors through Ray: unset = only to other nodes.",
    )
    compiled_graph: bool = Field(
        False,
        description="Run stages as a Ray compiled graph: ~1.5 ms less per batch; a core spins per "
        "stage actor and a dead actor means rebuilding its replica (docs/benchmarks.md).",
    )
    activation_dtype: ReducedDtype = Field(
        "float32",
        description="Float tensors crossing a cut travel in this dtype and are cast back on "
        "arrival (half the bytes at 16 bits); model outputs stay float32 (docs/benchmarks.md).",
    )
    weight_dtype: ReducedDtype = Field(
        "float32",
        description="Stage weights held in this dtype (half the memory at 16 bits), computing "
        "in float32 (docs/benchmarks.md).",
    )
    lookup_combine: LookupCombine = Field(
        DEFAULT_LOOKUP_COMBINE,
        description="How an embedding table split by rows (too large for one device) is joined "
        "when the server partitions the model: routed (each part sends only the vectors of the "
        "ids in its range and their positions, ~1/parts of the bytes) or dense (each part "
        "sends the whole lookup, zeros outside its rows); the same answer (docs/models.md).",
    )
    gpu_memory_limit: bool = Field(
        True,
        description="A stage actor on a GPU (a generating model's stages and head parts too) "
        "caps TensorFlow's memory at its planned peak x 1.25, so actors sharing a device keep "
        "their share; off: memory growth, no cap.",
    )
    simulate_device_ms: float | None = Field(
        None, ge=0, description="Benchmarks: shards sleep this long per batch instead of computing."
    )
    shard_max_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="Ray restarts of a dead shard actor before its replica is rebuilt.",
    )
    batch_hard_timeout_ms: float | None = Field(
        None,
        gt=0,
        le=3_600_000,
        description="Watchdog: a batch running longer (from when its first stage starts it) is "
        "abandoned, its stages restarted and its rows retried once on another healthy replica; "
        "unset = max(10 x p99 of batches of its size, 5 s).",
    )
    load_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        description="Longest the model may take to load (resolve, placement, shard actors, warm-up "
        "batch); past it the load fails with what it waited for, instead of waiting for ever.",
    )

    # --- the front end's process
    gc_freeze: bool = Field(
        True,
        description="Once a version is READY, collect and freeze what the load left alive "
        "(gc.freeze), so that the collector no longer scans it on the request path.",
    )
    # About 20 to 50 requests' young containers between gen-0 collections instead of CPython's
    # 700 (a few requests'): a gen-0 pass over 10,000 young objects takes well under a ms, and
    # reference counting still frees all but cycles at once (serving.version.collector).
    gc_first_threshold: int = Field(
        10_000,
        ge=100,
        le=10_000_000,
        description="Young objects between two collections of the first generation (CPython: "
        "700), set with gc_freeze; a server allocates per request (docs/tuning.md).",
    )

    driver_join_max_bytes: int = Field(
        2 * 1024 * MiB,
        ge=0,
        description="The most the front end may allocate to join a batch's output from the "
        "parts of a layer split across devices (e.g. 2GiB; shardserve plan shows it): a "
        "max_batch_size whose join is larger is refused at load, saying the batch size that "
        "fits.",
    )

    # --- batching
    max_batch_size: int = Field(32, ge=1, le=4096, description="Rows in a full batch.")
    batch_timeout_ms: WaitMs = Field(
        AUTO,
        description="Longest wait of a batch's oldest row: auto (the default) adapts it to the "
        "pipeline's load (docs/tuning.md); a number of ms fixes it (0 = at once).",
    )
    max_inflight_batches: int | None = Field(
        None, ge=1, le=1024, description="Batches out at once; unset = replicas x (stages + 1)."
    )
    max_queue_rows: int | None = Field(
        None, ge=1, description="Queued rows before 503; unset = 4 x batch x in-flight."
    )
    allowed_batch_sizes: Annotated[list[int] | None, NoDecode] = Field(
        None,
        description="Batch sizes a batch is padded to; unset = no padding on CPU stages, powers "
        "of two up to max on GPU stages (docs/tuning.md).",
    )
    fill_while_busy: bool = Field(
        True,
        description="A batch whose wait ran out while the first stage of every healthy replica "
        "is busy keeps taking rows until that stage is about to be free (or it is full, or a "
        "deadline needs it; the auto wait's share goes as it is); false = it closes on its wait "
        "alone (docs/tuning.md).",
    )
    request_timeout_ms: float = Field(
        30000.0, gt=0, le=3_600_000, description="Deadline of a request (header may shorten)."
    )
    slo_p99_ms: float | None = Field(
        None, gt=0, description="Latency target the auto timeout keeps the p99 under."
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlSource(settings_cls, _config_file.get()))

    @field_validator("imports", "allowed_batch_sizes", "allowed_lengths", mode="before")
    @classmethod
    def _csv_lists(cls, value: Any) -> Any:
        return split_csv(value)

    @field_validator("max_stage_bytes", mode="before")
    @classmethod
    def _budgets(cls, value: Any) -> Any:
        return None if value is None else list(parse_budgets(value))

    @field_validator("gpu_memory_bytes", mode="before")
    @classmethod
    def _gpu_memory(cls, value: Any) -> Any:
        return None if value is None else parse_bytes(value)

    @field_validator("device_overhead_bytes", mode="before")
    @classmethod
    def _overhead(cls, value: Any) -> Any:
        if value is None or (isinstance(value, int | str) and str(value).strip() == "0"):
            return None if value is None else 0
        return parse_bytes(value)

    @field_validator("cache_max_bytes", "driver_join_max_bytes", mode="before")
    @classmethod
    def _cache_bytes(cls, value: Any) -> Any:
        # 0 keeps only the bundles in use; parse_bytes refuses it as a budget.
        if isinstance(value, int | str) and str(value).strip() == "0":
            return 0
        return parse_bytes(value)

    @field_validator("stage_resources", mode="before")
    @classmethod
    def _json_resources(cls, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value

    @field_validator("batch_timeout_ms", mode="before")
    @classmethod
    def _timeout(cls, value: Any) -> WaitMs:
        return parse_wait_ms(value)

    @model_validator(mode="after")
    def _admin_token_from_file(self) -> Settings:
        if self.admin_token_file is None:
            return self
        try:
            token = self.admin_token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"admin_token_file {str(self.admin_token_file)!r}: {exc}") from None
        if not token:
            raise ValueError(f"admin_token_file {str(self.admin_token_file)!r} is empty")
        # A version's settings are copied whole (serving.repository.model_config): the same
        # token from both is that copy, not two sources.
        given = self.admin_token
        if given is not None and given.get_secret_value() != token:
            raise ValueError("give either admin_token or admin_token_file, not both")
        self.admin_token = SecretStr(token)
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> Settings:
        if self.grpc_port == self.port:
            raise ValueError(f"grpc_port and port are both {self.port}; give them different ports")
        if self.stages is not None and self.max_stage_bytes is not None:
            raise ValueError("give either stages or max_stage_bytes, not both")
        if self.allowed_batch_sizes is not None:
            bad = [s for s in self.allowed_batch_sizes if not 1 <= s <= self.max_batch_size]
            if bad or not self.allowed_batch_sizes:
                raise ValueError(
                    f"allowed_batch_sizes must be sizes between 1 and max_batch_size "
                    f"({self.max_batch_size}), got {self.allowed_batch_sizes}"
                )
        if self.max_queue_rows is not None and self.max_queue_rows < self.max_batch_size:
            raise ValueError(
                f"max_queue_rows ({self.max_queue_rows}) must be >= max_batch_size "
                f"({self.max_batch_size}) so that a batch can fill"
            )
        budgets = self.max_stage_bytes or []
        if self.stage_resources and len(budgets) > 1 and len(budgets) != len(self.stage_resources):
            raise ValueError(
                f"max_stage_bytes lists {len(budgets)} device budgets but stage_resources "
                f"{len(self.stage_resources)} stages; give one of each per stage"
            )
        if self.stage_resources and self.stages and len(self.stage_resources) != self.stages:
            raise ValueError(
                f"stage_resources has {len(self.stage_resources)} entries; "
                f"expected one per stage ({self.stages})"
            )
        return self

    # --- derived values
    @property
    def timeout_is_auto(self) -> bool:
        return is_auto(self.batch_timeout_ms)

    def padded_sizes(self) -> tuple[int, ...]:
        """The sizes a batch is padded to (and the shard actors warm up at)."""
        return padded_batch_sizes(self.max_batch_size, self.allowed_batch_sizes or ())

    def inflight_batches(self, stages: int, replicas: int = 1) -> int:
        """Default: the pipeline depth (stages x replicas) plus one batch per pipeline being
        handed over, so a stage never idles while the front end answers one batch and sends the
        next (measured in docs/benchmarks.md: overlap 0.85 -> 0.94 at K=4, heavy c64 +27%)."""
        return self.max_inflight_batches or max(1, replicas * (stages + 1))

    def queue_rows(self, stages: int, replicas: int = 1) -> int:
        inflight = self.inflight_batches(stages, replicas)
        return self.max_queue_rows or default_queue_rows(self.max_batch_size, inflight)

    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        path = Path(self.model)
        return path.stem if path.suffix else path.name


def padded_batch_sizes(max_batch_size: int, allowed: Iterable[int] = ()) -> tuple[int, ...]:
    """The sizes a batch may be padded to, sorted: ``allowed``, or powers of two up to
    ``max_batch_size`` when none are given; ``max_batch_size`` is always one. Both the server's
    settings (warm-up sizes) and ``BatchSettings`` (padding) read this one rule."""
    sizes = set(allowed) or {1 << i for i in range(max_batch_size.bit_length())}
    sizes.add(max_batch_size)
    return tuple(sorted(s for s in sizes if s <= max_batch_size))


def default_queue_rows(max_batch_size: int, inflight_batches: int) -> int:
    """Room for four rounds of full batches in every in-flight slot before 503s start."""
    return 4 * max_batch_size * inflight_batches


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings from flags (``overrides``, None = not given), env and a TOML file."""
    token = _config_file.set(config_file)
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None
    except SettingsError as exc:
        raise ConfigError(f"invalid settings: {exc}") from None
    finally:
        _config_file.reset(token)
