"""``shardserve partition`` and ``shardserve plan``: cut a model into stages and write a bundle, or
print the memory plan per stage without writing anything (its table: ``serving.cli.plan_table``)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import typer
from rich.console import Console

from shards.split.lookup import DEFAULT_LOOKUP_COMBINE, LookupCombine

err = Console(stderr=True)

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
_LOOKUP_HELP = (
    "How an embedding table split by rows is joined: routed (each part sends only the vectors "
    "of the ids in its range and their positions) or dense (each part sends the whole lookup, "
    "zeros outside its rows); the same answer."
)
_UNSAFE_HELP = (
    "Load a model holding Lambda layers or other Python code (Keras safe_mode off); only for "
    "models from a source you trust."
)

# The options partition and plan share (Typer reads them from these aliases, PlanFlags below).
StagesOption = Annotated[Optional[int], typer.Option(help=_STAGES_HELP, min=1)]  # noqa: UP045
BudgetOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--max-stage-bytes", help=_BUDGET_HELP, metavar="BYTES[,BYTES...]"),
]
BatchOption = Annotated[int, typer.Option(help=_BATCH_HELP, min=1)]
_LENGTH_HELP = (
    "What a dimension the model leaves unknown (a sequence length) is planned at; default: the "
    "model's own bound (a position embedding's rows), else 512. One over the bound is refused."
)
LengthOption = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option(help=_LENGTH_HELP, min=1, max=1_048_576),
]
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
# The choices are shards.split's (LookupCombine): Typer refuses another value naming them.
LookupOption = Annotated[
    LookupCombine, typer.Option("--lookup-combine", help=_LOOKUP_HELP, metavar="routed|dense")
]
LogLevelOption = Annotated[
    Literal["debug", "info", "warning", "error"],
    typer.Option(help="Log level; TensorFlow's own C++ log is shown at debug only."),
]


@dataclass(frozen=True)
class PlanFlags:
    """The flags ``partition`` and ``plan`` share, as given: their defaults are the commands'."""

    stages: StagesOption = None
    max_stage_bytes: BudgetOption = None
    max_batch_size: BatchOption = 32
    max_sequence_length: LengthOption = None
    device_overhead_bytes: OverheadOption = None
    imports: ImportsOption = None
    unsafe_deserialization: UnsafeOption = False
    weight_dtype: WeightDtypeOption = "float32"
    lookup_combine: LookupOption = DEFAULT_LOOKUP_COMBINE
    log_level: LogLevelOption = "warning"


def _with_plan_flags(command: Callable[..., None]) -> Callable[..., None]:
    """``command(..., *, flags: PlanFlags)`` as Typer reads a command: Typer takes the flags from
    the signature, so this one lists the command's own parameters, then one per ``PlanFlags``
    field (its ``Annotated`` type and default), and gathers those into ``flags`` for the call."""
    hints = inspect.get_annotations(PlanFlags, eval_str=True)
    shared = [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name]
        )
        for f in fields(PlanFlags)
    ]
    own = inspect.signature(command, eval_str=True).parameters.values()

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        flags = PlanFlags(**{f.name: kwargs.pop(f.name) for f in fields(PlanFlags)})
        command(*args, flags=flags, **kwargs)

    params = [p for p in own if p.name != "flags"] + shared
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return run


def _import_tensorflow_quietly(log_level: str) -> None:
    """Set the log levels, then load TensorFlow before anything else does (shards.actor.tflog)."""
    from shards.actor.tflog import import_tensorflow, set_tf_log_level

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    set_tf_log_level(log_level == "debug")
    import_tensorflow()


def _fail(exc: Exception, code: int = 1) -> typer.Exit:
    err.print(f"[red]error:[/red] {exc}", highlight=False)
    return typer.Exit(code)


def _plan_options(flags: PlanFlags) -> tuple[tuple[int, ...] | None, int | None]:
    if flags.stages is not None and flags.max_stage_bytes is not None:
        err.print("[red]error:[/red] give either --stages or --max-stage-bytes, not both")
        raise typer.Exit(2)
    from shards.partition.memory_plan import parse_budgets, parse_bytes

    try:
        budgets = None if flags.max_stage_bytes is None else parse_budgets(flags.max_stage_bytes)
        overhead = None
        given = flags.device_overhead_bytes
        if given is not None:
            overhead = 0 if given.strip() == "0" else parse_bytes(given)
    except ValueError as exc:
        raise _fail(exc, 2) from None
    return budgets, overhead


def _stdout() -> Console:
    out = Console()
    # Piped or captured, rich assumes 80 columns and would cut the table's cells.
    return out if out.is_terminal else Console(width=200)


@_with_plan_flags
def partition(
    model: Annotated[
        str, typer.Argument(help="A .keras file, a SavedModel dir or a demo model name.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Directory to write the bundle to.")],
    *,
    flags: PlanFlags,
) -> None:
    """Cut a Keras model into stages and write a bundle (manifest.json + one file per stage)."""
    budgets, overhead = _plan_options(flags)
    _import_tensorflow_quietly(flags.log_level)
    from shards.partition.cut import partition_to_bundle
    from shards.partition.demo_models import DEMO_MODELS, build_demo

    with err.status("partitioning...") as status:
        try:
            source: Any = build_demo(model) if model in DEMO_MODELS else model
            manifest = partition_to_bundle(
                source,
                out,
                source_name=f"demo:{model}" if model in DEMO_MODELS else None,
                stages=flags.stages,
                max_stage_bytes=budgets,
                imports=tuple(flags.imports or ()),
                progress=lambda step: status.update(step),
                plan_batch_rows=flags.max_batch_size,
                device_overhead_bytes=overhead,
                unsafe_deserialization=flags.unsafe_deserialization,
                weight_dtype=flags.weight_dtype,
                max_sequence_length=flags.max_sequence_length,
                lookup_combine=flags.lookup_combine,
            )
        except (ValueError, OSError) as exc:
            raise _fail(exc) from None
    for stage in manifest.stages:
        ins = ", ".join(t.name for t in stage.inputs)
        err.print(
            f"stage {stage.name}: {stage.param_bytes / 2**20:.1f} MiB of weights, inputs [{ins}]"
        )
    from serving.cli.plan_table import plan_table

    _stdout().print(plan_table(manifest.stages, manifest.signature, combines=manifest.combines))
    actors = "" if manifest.actors == len(manifest.stages) else f" ({manifest.actors} actors)"
    err.print(f"wrote {len(manifest.stages)} stage(s){actors} to {out}")


@_with_plan_flags
def plan(
    model: Annotated[
        str, typer.Argument(help="A .keras file, a bundle directory or a demo model name.")
    ],
    head_parts: Annotated[
        int,
        typer.Option(
            "--head-parts",
            help="A generating model's LM head split by vocabulary rows into this many parts "
            "(as serve's --head-parts); 1: the last stage holds it.",
            min=1,
        ),
    ] = 1,
    *,
    flags: PlanFlags,
) -> None:
    """Print the memory plan per stage (what partition would write), without writing anything.
    A bundle directory: the plan in its manifest."""
    budgets, overhead = _plan_options(flags)
    from serving.cli.plan_table import plan_table
    from shards.bundle.format import MANIFEST_NAME, read_manifest
    from shards.generation import is_generating_model

    if is_generating_model(model):
        _plan_generation(model, flags, head_parts)
        return
    if head_parts != 1:
        raise _fail(ValueError("--head-parts is for a generating model (a keras_hub preset)"))

    try:
        if (Path(model) / MANIFEST_NAME).is_file():
            if budgets is not None or flags.stages is not None or overhead is not None:
                raise ValueError(
                    f"{model!r} is a bundle: its plan was made when it was partitioned, and "
                    "the plan in its manifest is what this shows; drop --stages, "
                    "--max-stage-bytes and --device-overhead-bytes, or plan the source model"
                )
            manifest = read_manifest(model)
            specs, signature = list(manifest.stages), manifest.signature
            combines = manifest.combines
        else:
            _import_tensorflow_quietly(flags.log_level)
            with err.status("planning..."):
                specs, signature, combines = _plan_model(model, flags, budgets, overhead)
    except (ValueError, OSError) as exc:
        raise _fail(exc) from None
    budgeted = budgets is not None or any(s.memory and s.memory.budget_bytes for s in specs)
    _stdout().print(plan_table(specs, signature, budgeted=budgeted, combines=combines))


def _plan_generation(model: str, flags: PlanFlags, head_parts: int = 1) -> None:
    """A keras_hub CausalLM preset: its cut into ranges of decoder blocks, each stage's weights
    and KV cache (at the default KV slots), read from the preset's JSON alone."""
    from shards.generation.partition import describe_plan, plan_generation, resolve_max_length
    from shards.generation.preset import read_preset

    kv_slots = 8
    try:
        spec = read_preset(model)
        length = resolve_max_length(spec, flags.max_sequence_length)
        plans = plan_generation(spec, flags.stages or 1, kv_slots, length, head_parts)
    except (ValueError, OSError) as exc:
        raise _fail(exc) from None
    for line in describe_plan(spec, plans, kv_slots, length, head_parts):
        _stdout().print(line, highlight=False, markup=False)


def _plan_model(
    model: str, flags: PlanFlags, budgets: tuple[int, ...] | None, overhead: int | None
) -> tuple[list[Any], Any, Any]:
    from shards.bundle.format import import_modules, load_keras
    from shards.errors import PartitionError
    from shards.partition.demo_models import DEMO_MODELS, build_demo
    from shards.partition.graph import analyse
    from shards.partition.stages import plan_bundle

    import_modules(flags.imports or ())
    path = Path(model)
    if model in DEMO_MODELS:
        keras_model = build_demo(model)
    elif path.is_file() and path.suffix == ".keras":
        keras_model = load_keras(
            path,
            repr(str(path)),
            unsafe_deserialization=flags.unsafe_deserialization,
            error=PartitionError,
        )
    else:
        raise ValueError(
            f"cannot plan {model!r}: expected a bundle directory (with manifest.json), a .keras "
            f"file or a demo model name ({', '.join(DEMO_MODELS)}); a TF SavedModel is served "
            "whole, as one stage"
        )
    graph = analyse(keras_model, flags.max_sequence_length)
    planned = plan_bundle(
        graph,
        stages=flags.stages,
        max_stage_bytes=budgets,
        plan_batch_rows=flags.max_batch_size,
        device_overhead_bytes=overhead,
        weight_dtype=flags.weight_dtype,
        lookup_combine=flags.lookup_combine,
    )
    return [spec for _, spec in planned.stages], graph.signature, planned.combines
