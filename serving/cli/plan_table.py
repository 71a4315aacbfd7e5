"""The memory plan as ``shardserve plan`` and ``partition`` print it: one row per stage, read
from the stages' specs (the same numbers ``partition`` writes into the manifest)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from shards.bundle.format import StageSpec
from shards.partition.memory_plan import format_size
from shards.signature import ModelSignature
from shards.split import DriverCombine, join_row_bytes

COLUMNS = (
    "stage",
    "layers",
    "weights",
    "activations",
    "overhead",
    "total",
    "budget",
    "FLOPs",
    "sends/row",
)


def plan_rows(stages: Sequence[StageSpec]) -> list[tuple[str, ...]]:
    """The table's cells: ``?`` where a manifest written before the memory plan has no figure;
    activations marked ``*`` where a dimension unknown in the graph was counted as the plan's
    sequence length (``length_line``)."""
    flops = sum(s.flops_per_row for s in stages) or 1
    rows: list[tuple[str, ...]] = []
    for spec in stages:
        mem = spec.memory
        share = f"{100 * spec.flops_per_row / flops:.1f}%"
        if mem is None:
            rows.append(
                (
                    spec.name,
                    "?",
                    format_size(spec.param_bytes),
                    "?",
                    "?",
                    "?",
                    "-",
                    share,
                    "?",
                )
            )
            continue
        total = spec.planned_peak_bytes
        budget = "-"
        if mem.budget_bytes is not None:
            budget = f"{format_size(mem.budget_bytes)} ({100 * total / mem.budget_bytes:.0f}%)"
        rows.append(
            (
                spec.name,
                _layers(spec),
                _weights(spec),
                format_size(mem.activation_bytes) + ("*" if mem.unknown_dims else ""),
                format_size(mem.overhead_bytes),
                format_size(total),
                budget,
                share,
                format_size(mem.crossing_bytes_per_row),
            )
        )
    return rows


def _layers(spec: StageSpec) -> str:
    mem, part = spec.memory, spec.part
    if part is not None:
        use = "" if part.use is None else f" {part.use}"
        return f"{part.layer}{use} {part.how} [{part.start}, {part.stop})"
    return "?" if mem is None else f"{mem.first_layer}..{mem.last_layer}"


def split_lines(stages: Sequence[StageSpec]) -> list[str]:
    """One line per layer split across devices: how, its parts and their stages."""
    found: dict[str, list[StageSpec]] = {}
    for spec in stages:
        if spec.part is not None:
            found.setdefault(spec.part.group, []).append(spec)
    lines = []
    for specs in found.values():
        part = specs[0].part
        assert part is not None
        unit = "rows (vocabulary ranges)" if part.how == "rows" else "output units"
        where = ", ".join(s.name for s in specs)
        if part.how == "pair":
            lines.append(
                f"{part.layer} ({part.kind}) and the Dense it feeds are larger than one device: "
                f"paired, split by the hidden units into {part.parts} parts on stages {where}, "
                "run side by side, each keeping its slice of the hidden activation; the next "
                "stage sums their partial products (the driver, for a model output)"
            )
            continue
        if part.use is not None and part.held_by is not None:
            hosts = ", ".join(
                stages[s.part.held_by].name
                for s in specs
                if s.part is not None and s.part.held_by is not None
            )
            lines.append(
                f"{part.layer} ({part.kind}) {part.use}: held once, stages {where} run by the "
                f"actors of {hosts} (its rows held there once, one device each, its logits in a "
                "concurrency group of their own); each part the logits of its rows, joined by "
                "the next stage (the driver, for a model output)"
            )
            continue
        if part.use is not None:
            lines.append(
                f"{part.layer} ({part.kind}) {part.use}: the same rows held again, in "
                f"{part.parts} parts on stages {where}, run side by side; each part the logits "
                "of its rows, joined by the next stage (the driver, for a model output)"
            )
            continue
        lines.append(
            f"{part.layer} ({part.kind}) is larger than one device: split by {unit} into "
            f"{part.parts} parts on stages {where}, run side by side; the next stage combines them"
            " (the driver, for a model output)"
        )
    return lines


NO_BUDGET_LINE = (
    "no --max-stage-bytes: no layer is split across devices (a layer larger than one device is "
    "split only under a budget)"
)


def _weights(spec: StageSpec) -> str:
    mem = spec.memory
    if mem is None or mem.weight_bytes is None:
        return format_size(spec.param_bytes)
    return f"{format_size(mem.weight_bytes)} ({mem.weight_dtype})"


def plan_table(
    stages: Sequence[StageSpec],
    signature: ModelSignature | None = None,
    *,
    budgeted: bool = True,
    combines: Sequence[DriverCombine] = (),
) -> Table:
    """``budgeted=False``: planned without a budget, which the caption says splits nothing.
    ``combines``: the outputs the front end joins, whose memory the caption counts."""
    batch = next((s.memory.plan_batch_rows for s in stages if s.memory), None)
    title = "memory plan" + (f" at max_batch_size={batch}" if batch else "")
    table = Table(title=title, title_justify="left")
    for name in COLUMNS:
        table.add_column(name, justify="left" if name == "layers" else "right", no_wrap=True)
    for row in plan_rows(stages):
        table.add_row(*row)
    lines = [
        length_line(stages),
        None if signature is None else bound_line(signature),
        *split_lines(stages),
        None if signature is None else join_line(stages, signature, combines),
        None if budgeted else NO_BUDGET_LINE,
    ]
    table.caption = "\n".join(line for line in lines if line) or None
    return table


def join_line(
    stages: Sequence[StageSpec], signature: ModelSignature, combines: Sequence[DriverCombine]
) -> str | None:
    """What the front end's joins of a split output take at the plan's batch and length."""
    if not combines:
        return None
    mem = next((s.memory for s in stages if s.memory), None)
    batch = mem.plan_batch_rows if mem else 1
    length = mem.sequence_length if mem else 1
    per_row = join_row_bytes(tuple(combines), signature, length)
    outputs = ", ".join(c.output for c in combines)
    return (
        f"the front end joins {outputs} from the parts: {format_size(per_row)} a row, "
        f"{format_size(per_row * batch)} at batch {batch} (within driver_join_max_bytes, or "
        "the server refuses the batch size at load)"
    )


def bound_line(signature: ModelSignature) -> str | None:
    """The longest length the model takes along its unknown dimensions, where it bounds it."""
    bounded = [f"{t.name} {t.max_length}" for t in signature.inputs if t.max_length is not None]
    if not bounded:
        return None
    return (
        f"max sequence length {signature.max_length}, the model's own bound (positions: "
        f"{', '.join(bounded)}); served up to it unless --max-sequence-length lowers it"
    )


def length_line(stages: Sequence[StageSpec]) -> str | None:
    """The sequence length the plan counted a dimension unknown in the graph as, where one was."""
    lengths = sorted(
        {s.memory.sequence_length for s in stages if s.memory and s.memory.unknown_dims}
    )
    if not lengths:
        return None
    shown = ", ".join(str(n) for n in lengths)
    return (
        f"* a dimension unknown in the graph (a sequence length) counted as {shown} "
        "(--max-sequence-length)"
    )
