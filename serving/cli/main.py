"""The ``shardserve`` command: ``serve``, ``partition``, ``plan``, ``cache`` (serving.cli.cache)
and ``tune`` (from loadtest).

``serve`` has one flag per setting, generated from ``Settings`` so that the flags, the env vars
and the TOML keys can never drift apart.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import typer
from rich.console import Console

from serving.cli.cache import app as cache_app
from serving.config import ConfigError, Settings, load_settings

app = typer.Typer(
    name="shardserve",
    help="Batched inference serving for Keras models sharded over Ray actors.",
    no_args_is_help=True,
    add_completion=False,
)
err = Console(stderr=True)

_METAVARS = {int: "INT", float: "FLOAT", bool: "BOOL"}


def _metavar(annotation: Any) -> str:
    if "Literal['auto']" in str(annotation):
        return "MS|auto"
    for kind, name in _METAVARS.items():
        if kind is annotation or kind in getattr(annotation, "__args__", ()):
            return name
    return "TEXT"


def flag_name(field: str) -> str:
    return "--" + ("import" if field == "imports" else field.replace("_", "-"))


def _setting_parameters() -> list[inspect.Parameter]:
    params = []
    for name, info in Settings.model_fields.items():
        default = info.get_default(call_default_factory=True)
        shown = "unset" if default in (None, []) else str(default)
        help_text = f"{info.description} (env SHARDSERVE_{name.upper()}, default {shown})"
        if name == "imports":
            option = typer.Option(
                None, flag_name(name), help=help_text + ", repeatable", metavar="MODULE"
            )
            annotation: Any = Optional[list[str]]  # noqa: UP045 - typer reads the annotation
        else:
            option = typer.Option(
                None, flag_name(name), help=help_text, metavar=_metavar(info.annotation)
            )
            annotation = Optional[str]  # noqa: UP045
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation
            )
        )
    return params


def _with_setting_flags(func: Any) -> Any:
    sig = inspect.signature(func)
    fixed = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    func.__signature__ = sig.replace(parameters=[*fixed, *_setting_parameters()])
    return func


@_with_setting_flags
def serve(
    config: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--config", help="TOML file of settings (flags and env vars override it)."),
    ] = None,
    **flags: Any,
) -> None:
    """Serve a model over HTTP: POST /predict, batched and pipelined over Ray shard actors."""
    try:
        settings = load_settings(config, **flags)
    except ConfigError as exc:
        err.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        raise typer.Exit(2) from None
    run_server(settings)


def run_server(settings: Settings) -> None:
    # Read when grpc is first imported. Its fork handlers serve children that keep using gRPC;
    # this process forks only to exec (Ray starting its processes), and with the gRPC server up
    # the handlers bail out with a log line per fork.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    import uvicorn

    from serving.http.protocol import http_protocol
    from serving.server.app import create_app
    from serving.server.graceful import GracefulServer
    from shards.actor.tflog import set_tf_log_level

    # Before Ray starts: the workers it starts (shard actors, the resolve task) inherit it.
    set_tf_log_level(settings.log_level == "debug")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    server: GracefulServer | None = None

    def stop_serving(_: str) -> None:
        if server is not None:
            server.should_exit = True

    api = create_app(settings, on_load_failure=stop_serving)
    server = GracefulServer(
        uvicorn.Config(
            api,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=False,
            # The server never reads the client address; the proxy-headers layer costs CPU
            # on every request (py-spy, docs/benchmarks.md).
            proxy_headers=False,
            # Queue-full 503s answered from the request's headers, before any ASGI work;
            # hang-ups reported without a watcher task (serving/http/protocol.py).
            http=http_protocol(api),
        ),
        state_of=lambda: getattr(api.state, "shardserve", None),
        stop_timeout_s=settings.stop_timeout_s,
    )
    server.run()
    state = getattr(api.state, "shardserve", None)
    if state is not None and state.load_error:
        err.print(f"[red]error:[/red] the model failed to load: {state.load_error}")
        raise typer.Exit(1)


app.command("serve")(serve)
app.add_typer(cache_app)


_STAGES_HELP = "Balanced stages to cut."
_BUDGET_HELP = (
    "Memory budget per device (weights + activations + overhead), with units: 16GiB = the "
    "fewest stages that fit; 16GiB,16GiB,40GiB = stage i fits device i."
)
_BATCH_HELP = "Rows in a full batch: activations are planned at this size."
_WEIGHT_DTYPE_HELP = "Plan the weights as served in this dtype: float32, bfloat16 or float16."
_OVERHEAD_HELP = (
    "A device's own memory before any weight, e.g. 1GiB; default 1 GiB on a GPU, 700 MiB on a CPU."
)
_UNSAFE_HELP = (
    "Load a model holding Lambda layers or other Python code (Keras safe_mode off); only for "
    "models from a source you trust."
)

# The options partition and plan share (Typer reads them from these aliases).
StagesOption = Annotated[Optional[int], typer.Option(help=_STAGES_HELP, min=1)]  # noqa: UP045
BudgetOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--max-stage-bytes", help=_BUDGET_HELP, metavar="BYTES[,BYTES...]"),
]
BatchOption = Annotated[int, typer.Option(help=_BATCH_HELP, min=1)]
OverheadOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--device-overhead-bytes", help=_OVERHEAD_HELP, metavar="BYTES"),
]
ImportsOption = Annotated[
    Optional[list[str]],  # noqa: UP045
    typer.Option("--import", help="Module to import first (custom layers); repeatable."),
]
UnsafeOption = Annotated[bool, typer.Option("--unsafe-deserialization", help=_UNSAFE_HELP)]
WeightDtypeOption = Annotated[
    str, typer.Option("--weight-dtype", help=_WEIGHT_DTYPE_HELP, metavar="DTYPE")
]
LogLevelOption = Annotated[
    Literal["debug", "info", "warning", "error"],
    typer.Option(help="Log level; TensorFlow's own C++ log is shown at debug only."),
]


def _import_tensorflow_quietly(log_level: str) -> None:
    """Set the log levels, then load TensorFlow before anything else does (shards.actor.tflog)."""
    from shards.actor.tflog import import_tensorflow, set_tf_log_level

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    set_tf_log_level(log_level == "debug")
    import_tensorflow()


def _fail(exc: Exception, code: int = 1) -> typer.Exit:
    err.print(f"[red]error:[/red] {exc}", highlight=False)
    return typer.Exit(code)


def _plan_options(
    stages: int | None, max_stage_bytes: str | None, device_overhead_bytes: str | None
) -> tuple[tuple[int, ...] | None, int | None]:
    if stages is not None and max_stage_bytes is not None:
        err.print("[red]error:[/red] give either --stages or --max-stage-bytes, not both")
        raise typer.Exit(2)
    from shards.partition.memory import parse_budgets, parse_bytes

    try:
        budgets = None if max_stage_bytes is None else parse_budgets(max_stage_bytes)
        overhead = None
        if device_overhead_bytes is not None:
            overhead = (
                0 if device_overhead_bytes.strip() == "0" else parse_bytes(device_overhead_bytes)
            )
    except ValueError as exc:
        raise _fail(exc, 2) from None
    return budgets, overhead


def _stdout() -> Console:
    out = Console()
    # Piped or captured, rich assumes 80 columns and would cut the table's cells.
    return out if out.is_terminal else Console(width=200)


@app.command("partition")
def partition(
    model: Annotated[
        str, typer.Argument(help="A .keras file, a SavedModel dir or a demo model name.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Directory to write the bundle to.")],
    stages: StagesOption = None,
    max_stage_bytes: BudgetOption = None,
    max_batch_size: BatchOption = 32,
    device_overhead_bytes: OverheadOption = None,
    imports: ImportsOption = None,
    unsafe_deserialization: UnsafeOption = False,
    weight_dtype: WeightDtypeOption = "float32",
    log_level: LogLevelOption = "warning",
) -> None:
    """Cut a Keras model into stages and write a bundle (manifest.json + one file per stage)."""
    budgets, overhead = _plan_options(stages, max_stage_bytes, device_overhead_bytes)
    _import_tensorflow_quietly(log_level)
    from shards.partition.cut import partition_to_bundle
    from shards.partition.demo_models import DEMO_MODELS, build_demo

    with err.status("partitioning...") as status:
        try:
            source: Any = build_demo(model) if model in DEMO_MODELS else model
            manifest = partition_to_bundle(
                source,
                out,
                source_name=f"demo:{model}" if model in DEMO_MODELS else None,
                stages=stages,
                max_stage_bytes=budgets,
                imports=tuple(imports or ()),
                progress=lambda step: status.update(step),
                max_batch_size=max_batch_size,
                device_overhead_bytes=overhead,
                unsafe_deserialization=unsafe_deserialization,
                weight_dtype=weight_dtype,
            )
        except (ValueError, OSError) as exc:
            raise _fail(exc) from None
    for stage in manifest.stages:
        ins = ", ".join(t.name for t in stage.inputs)
        err.print(
            f"stage {stage.index}: {stage.param_bytes / 2**20:.1f} MiB of weights, inputs [{ins}]"
        )
    from serving.cli.plan_table import plan_table

    _stdout().print(plan_table(manifest.stages))
    err.print(f"wrote {len(manifest.stages)} stage(s) to {out}")


@app.command("plan")
def plan(
    model: Annotated[
        str, typer.Argument(help="A .keras file, a bundle directory or a demo model name.")
    ],
    stages: StagesOption = None,
    max_stage_bytes: BudgetOption = None,
    max_batch_size: BatchOption = 32,
    device_overhead_bytes: OverheadOption = None,
    imports: ImportsOption = None,
    unsafe_deserialization: UnsafeOption = False,
    weight_dtype: WeightDtypeOption = "float32",
    log_level: LogLevelOption = "warning",
) -> None:
    """Print the memory plan per stage (what partition would write), without writing anything.
    A bundle directory: the plan in its manifest."""
    budgets, overhead = _plan_options(stages, max_stage_bytes, device_overhead_bytes)
    from serving.cli.plan_table import plan_table
    from shards.bundle.format import MANIFEST_NAME, read_manifest

    try:
        if (Path(model) / MANIFEST_NAME).is_file():
            if budgets is not None or stages is not None or overhead is not None:
                raise ValueError(
                    f"{model!r} is a bundle: its plan was made when it was partitioned, and "
                    "the plan in its manifest is what this shows; drop --stages, "
                    "--max-stage-bytes and --device-overhead-bytes, or plan the source model"
                )
            specs = list(read_manifest(model).stages)
        else:
            _import_tensorflow_quietly(log_level)
            with err.status("planning..."):
                specs = _plan_model(
                    model,
                    stages,
                    budgets,
                    max_batch_size,
                    overhead,
                    imports,
                    unsafe_deserialization,
                    weight_dtype=weight_dtype,
                )
    except (ValueError, OSError) as exc:
        raise _fail(exc) from None
    _stdout().print(plan_table(specs))


def _plan_model(
    model: str,
    stages: int | None,
    budgets: tuple[int, ...] | None,
    max_batch_size: int,
    overhead: int | None,
    imports: list[str] | None,
    unsafe_deserialization: bool,
    *,
    weight_dtype: str,
) -> list[Any]:
    from shards.bundle.format import import_modules, load_keras
    from shards.errors import PartitionError
    from shards.partition.cut import plan_stages
    from shards.partition.demo_models import DEMO_MODELS, build_demo
    from shards.partition.graph import analyse

    import_modules(imports or ())
    path = Path(model)
    if model in DEMO_MODELS:
        keras_model = build_demo(model)
    elif path.is_file() and path.suffix == ".keras":
        keras_model = load_keras(
            path,
            repr(str(path)),
            unsafe_deserialization=unsafe_deserialization,
            error=PartitionError,
        )
    else:
        raise ValueError(
            f"cannot plan {model!r}: expected a bundle directory (with manifest.json), a .keras "
            f"file or a demo model name ({', '.join(DEMO_MODELS)}); a TF SavedModel is served "
            "whole, as one stage"
        )
    planned = plan_stages(
        analyse(keras_model),
        stages=stages,
        max_stage_bytes=budgets,
        max_batch_size=max_batch_size,
        device_overhead_bytes=overhead,
        weight_dtype=weight_dtype,
    )
    return [spec for _, spec in planned]


@app.command("tune")
def tune(
    url: Annotated[str, typer.Option("--url", help="Base URL of a running shardserve server.")],
    out: Annotated[Path, typer.Option("--out", help="Directory for the results and report.")],
    timeouts: Annotated[
        str, typer.Option(help="batch_timeout_ms values to try, comma-separated; 'auto' too.")
    ] = "0,1,2,5,10,20,auto",
    loads: Annotated[
        str, typer.Option(help="Load levels: user counts (closed loop) or rates like 200rps.")
    ] = "4,16,64",
    duration: Annotated[float, typer.Option(help="Seconds measured per point.", min=1)] = 20.0,
    warmup: Annotated[
        float, typer.Option(help="Seconds of warm-up per point, not measured.", min=0)
    ] = 3.0,
    slo_p99_ms: Annotated[
        Optional[float],  # noqa: UP045
        typer.Option("--slo-p99-ms", help="p99 target; the winner is the fastest under it."),
    ] = None,
    max_batch_sizes: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--max-batch-sizes", help="Also sweep these max_batch_size values."),
    ] = None,
    rows: Annotated[int, typer.Option(help="Rows per request.", min=1)] = 1,
    repeats: Annotated[
        int, typer.Option(help="Runs per point, interleaved; the report gives medians.", min=1)
    ] = 1,
    model_name: Annotated[str, typer.Option(help="Served model name; default: asked.")] = "",
    protocol: Annotated[
        str,
        typer.Option(
            help="Request format: tfserving (/predict JSON), v2-json or v2-binary (/v2 infer)."
        ),
    ] = "tfserving",
    admin_token: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(envvar="SHARDSERVE_ADMIN_TOKEN", help="The server's admin token."),
    ] = None,
) -> None:
    """Sweep batch_timeout_ms (x load x batch size) with Locust; write a report and a config."""
    missing = [m for m in ("locust", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        err.print(
            f"[red]error:[/red] shardserve tune needs {' and '.join(missing)}: "
            "pip install 'shardserve\\[loadtest]'",  # \[ : not a rich markup tag
            highlight=False,
        )
        raise typer.Exit(2)
    from loadtest.tune import TuneConfig, parse_loads, parse_protocol, parse_sizes, parse_timeouts
    from loadtest.tune import tune as run_tune

    try:
        config = TuneConfig(
            url=url,
            timeouts=parse_timeouts(timeouts),
            loads=parse_loads(loads),
            duration_s=duration,
            out=out,
            slo_p99_ms=slo_p99_ms,
            max_batch_sizes=parse_sizes(max_batch_sizes),
            warmup_s=warmup,
            rows=rows,
            admin_token=admin_token,
            model_name=model_name,
            repeats=repeats,
            protocol=parse_protocol(protocol),
        )
        code = run_tune(config)
    except (ValueError, RuntimeError) as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2 if isinstance(exc, ValueError) else 1) from None
    raise typer.Exit(code)


def main() -> None:  # pragma: no cover - console entry for `python -m serving.cli.main`
    app(prog_name="shardserve")


if __name__ == "__main__":  # pragma: no cover
    main()
