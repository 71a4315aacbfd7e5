"""The plan rule of a split: which layers can be split and how (their kinds), into how many parts
(the fewest whose weights and activations each fit the budget), and each part's range.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import keras

from shards.errors import PlanError
from shards.sizes import row_bytes
from shards.split.layers import einsum_letters

SPLITTABLE = (
    "Embedding (mask_zero too), keras_hub's ReversibleEmbedding, Dense and EinsumDense, and "
    "keras_hub's TokenAndPositionEmbedding (its token table) and a ReversibleEmbedding's logits "
    "(reverse=True)"
)
PART_MARK = "_part"
# The use of a tied table's parts that hold its rows again, as logits over the vocabulary.
LOGITS = "logits"


@dataclass(frozen=True)
class Split:
    """One layer split: how (``rows``, ``columns`` or ``pair``), its parts' ranges along that
    axis. A ``pair`` is a column-split ``Dense`` (``layer``) and the row-split ``Dense`` its
    output feeds (``pair``) through the elementwise layers ``between`` (their activations in
    ``steps``): part k holds the first layer's output units and the second layer's input units
    ``[bounds[k], bounds[k + 1])``, and only the partial sums leave it."""

    layer: str
    kind: str
    how: str
    size: int  # rows of the table, or output units
    bounds: tuple[int, ...]  # parts' ranges: [bounds[k], bounds[k + 1])
    # A table also called with reverse=True (a tied embedding's logits): a second set of parts
    # holds the same rows for that use.
    reversed: bool = False
    pair: str | None = None
    between: tuple[str, ...] = ()
    steps: tuple[str, ...] = ()
    # A tied table (its logits read its own rows) held once: part k's lookup and its logits
    # served by one actor (``StagePart.held_by``), its rows in one place.
    held_once: bool = False

    @property
    def parts(self) -> int:
        return len(self.bounds) - 1

    def more(self) -> Split:
        """The same layer in one more part."""
        return replace(self, bounds=bounds_for(self.size, self.parts + 1))

    def part_name(self, k: int, use: str | None = None) -> str:
        mark = PART_MARK if use is None else f"_{use}{PART_MARK}"
        return f"{self.layer}{mark}{k}of{self.parts}"


def token_and_position(op: Any) -> bool:
    """keras_hub's TokenAndPositionEmbedding (keras_hub imported only where it is in use)."""
    return any(c.__name__ == "TokenAndPositionEmbedding" for c in type(op).__mro__)


def table_of(op: Any) -> Any:
    """The embedding layer whose rows are split: the layer itself, or the token table of a
    TokenAndPositionEmbedding."""
    return op.token_embedding if token_and_position(op) else op


def _kind(op: Any) -> str | None:
    """``rows``, ``columns`` or None (cannot be split). A quantized layer is refused here, at
    plan time, by name: its parts would hold float kernels without the scale."""
    quantized = getattr(table_of(op) if token_and_position(op) else op, "quantization_mode", None)
    if quantized is not None and _kind_of(op) is not None:
        raise PlanError(
            f"layer {op.name!r} ({type(op).__name__}) is quantized ({quantized}) and too large "
            "for one device; a quantized layer cannot be split (its scale would have to be "
            "split with its kernel): raise the budget, or split the float model and quantize "
            "after"
        )
    return _kind_of(op)


def _kind_of(op: Any) -> str | None:
    if isinstance(op, keras.layers.Embedding) or token_and_position(op):
        return "rows"
    if isinstance(op, keras.layers.Dense | keras.layers.EinsumDense):
        return "columns"
    return None


def reads_own_rows(op: Any) -> bool:
    """A table whose logits read its own rows (tied), not a reverse table of their own."""
    return bool(getattr(op, "tie_weights", True)) and not token_and_position(op)


def reversed_call(node: Any) -> bool:
    return bool(node.arguments.kwargs.get("reverse"))


def uses(calls: Sequence[Any], how: str) -> list[tuple[str, list[Any]]]:
    """A split layer's calls by use, each with how its parts divide the output: a table's
    lookups (rows: every part writes the whole output) and its reverse calls (the logits over
    the vocabulary: each part its columns)."""
    found = [(how, [n for n in calls if not reversed_call(n)])]
    found.append(("columns", [n for n in calls if reversed_call(n)]))
    return [(h, nodes) for h, nodes in found if nodes]


def units_axis(op: Any) -> tuple[str, int, int]:
    """An EinsumDense's output-units letter, its kernel axis and its size: the last letter of
    the output that the kernel has and the input has not."""
    kernel = tuple(op.kernel.shape)
    ranks = [len(op.input.shape) if hasattr(op, "input") else len(kernel), len(kernel)]
    (x, k), out = einsum_letters(op.equation, ranks)
    letters = [c for c in out if c in k and c not in x]
    if not letters:
        raise PlanError(
            f"layer {op.name!r} (EinsumDense {op.equation!r}) has no output axis of its own to "
            "split; raise the budget"
        )
    letter = letters[-1]
    return letter, k.index(letter), kernel[k.index(letter)]


def _size(op: Any, how: str) -> int:
    if isinstance(op, keras.layers.Embedding) or token_and_position(op):
        return int(table_of(op).input_dim)
    if isinstance(op, keras.layers.Dense):
        return int(op.units)
    return units_axis(op)[2]


def use_weight_bytes(op: Any, weight_bytes: int, reverse: bool) -> int:
    """The share of a layer's ``weight_bytes`` one use reads: an untied ``ReversibleEmbedding``'s
    lookups read its table and its logits its own reverse table, so each use is charged its own
    matrix, not both; any other layer (a tied table too: one matrix) all of them."""
    if getattr(op, "tie_weights", True) or getattr(op, "reverse_embeddings", None) is None:
        return weight_bytes
    matrix = op.reverse_embeddings if reverse else table_of(op).embeddings
    total = sum(math.prod(w.shape) for w in op.weights)
    return weight_bytes * math.prod(matrix.shape) // total if total else weight_bytes


def bounds_for(size: int, parts: int) -> tuple[int, ...]:
    return tuple(k * size // parts for k in range(parts + 1))


def refuse(op: Any, need_text: str, budget_text: str, need: int) -> PlanError:
    """The refusal of a layer too large that cannot be split, by name and kind."""
    return PlanError(
        f"layer {op.name!r} alone holds {need_text}, more than {budget_text}; raise the budget "
        f"to at least {need} bytes. A {type(op).__name__} cannot be split across devices: the "
        f"kinds that can are {SPLITTABLE}"
    )


def routes(op: Any, how: str, calls: Sequence[Any], outputs: Sequence[Any], combine: str) -> bool:
    """Whether a use of a layer split by rows is joined routed (``combine``: ``routed``): its
    lookups, where routing applies (not a TokenAndPositionEmbedding's token table, whose
    positions read the lookup's shape; not a lookup that is a model output, which the driver
    joins with numpy's add; never the logits, split by columns)."""
    ends = {id(t) for t in outputs}
    return (
        combine == "routed"
        and how == "rows"
        and not any(reversed_call(n) for n in calls)
        and not token_and_position(op)
        and not any(id(t) in ends for n in calls for t in n.outputs)
    )


def parts_needed(
    op: Any,
    how: str,
    calls: Sequence[Any],
    weight_bytes: int,
    overhead: int,
    batch: int,
    sequence_length: int,
    budget: int,
    routed: bool = False,
    beside: Sequence[tuple[str, Sequence[Any]]] = (),
) -> int | None:
    """The fewest parts whose weights and activations each fit ``budget``; None when no number
    does (the activations and overhead alone are over it). By rows every part writes the whole
    output (zeros outside its rows); routed (``routes``), at worst the same, every id of the
    batch in its range, plus 4 bytes an id of position; by columns its share of it.
    ``beside``: other uses (how, calls) the same parts serve at the same time (a tied table held
    once: its logits beside its lookups), their activations counted too, the weights once."""
    divided = fixed = 0
    for k, (use_how, use_calls) in enumerate([(how, calls), *beside]):
        held, out = _activation_row_bytes(use_calls, sequence_length, routed and k == 0)
        fixed += held + (out if use_how == "rows" else 0)
        divided += 0 if use_how == "rows" else out
    size = _size(op, how)
    for parts in range(2, size + 1):
        share = math.ceil(weight_bytes / parts)
        activations = (fixed + math.ceil(divided / parts)) * batch
        if share + activations + overhead <= budget:
            return parts
        if fixed * batch + overhead > budget:
            return None
    return None


def _activation_row_bytes(
    calls: Sequence[Any], sequence_length: int, routed: bool = False
) -> tuple[int, int]:
    """A use's inputs and outputs, bytes a row (routed: plus an int32 position an id)."""
    held = out = 0
    for node in calls:
        for t in {id(t): t for t in node.input_tensors}.values():
            held += row_bytes(tuple(t.shape), str(t.dtype), sequence_length)[0]
        for t in node.outputs:
            out += row_bytes(tuple(t.shape), str(t.dtype), sequence_length)[0]
        if routed:
            ids = node.input_tensors[0]
            out += row_bytes(tuple(ids.shape), "int32", sequence_length)[0]
    return held, out


def pair_parts_needed(
    first: Any,
    second: Any,
    weight_bytes: int,
    overhead: int,
    batch: int,
    sequence_length: int,
    budget: int,
) -> int | None:
    """The fewest parts of a pair (``find_pairs``: ``first`` and ``second`` the two layers'
    calls, each layer called once) that each fit ``budget``: its share of both layers'
    ``weight_bytes``, the first layer's input (held for the call), its slice of the hidden
    activation (the first layer's output units, kept inside the part) and the second layer's
    whole output (its partial product); None when none does."""
    held = sum(
        row_bytes(tuple(t.shape), str(t.dtype), sequence_length)[0]
        for t in {id(t): t for t in first.input_tensors}.values()
    )
    (hidden_tensor,), (out_tensor,) = first.outputs, second.outputs
    hidden = row_bytes(tuple(hidden_tensor.shape), str(hidden_tensor.dtype), sequence_length)[0]
    out = row_bytes(tuple(out_tensor.shape), str(out_tensor.dtype), sequence_length)[0]
    for parts in range(2, _size(first.operation, "columns") + 1):
        share = math.ceil(weight_bytes / parts)
        if share + (held + math.ceil(hidden / parts) + out) * batch + overhead <= budget:
            return parts
    return None


def choose_splits(
    nodes: Sequence[Any],
    over: Callable[[int], tuple[int, str] | None],
    parts_for: Callable[[int, Any, str], int | None],
    budget_text: str,
    outputs: Sequence[Any] = (),
    pair_parts: Callable[[Any, Any], int | None] | None = None,
    pair_dense: bool = True,
    tied_tables: str = "once",
) -> list[Split]:
    """The layers to split and into how many parts. ``over(i)``: node i's need and its text when
    it exceeds the largest budget; ``parts_for(i, op, how)``: the fewest parts that fit. Two
    split ``Dense`` layers that pair (``find_pairs``; ``outputs``: the model's outputs) become
    one ``pair`` split in as many parts as the larger needs, or as ``pair_parts(first,
    second)`` (``pair_parts_needed``: both layers' weights, the hidden slice each part keeps)
    needs where that is more (the two layers' calls; the planner adds parts where one is still
    over). ``pair_dense=False``: no pairs, each ``Dense`` split by columns alone (the
    layout before pairs, which ``python -m bench split`` measures against them).
    ``tied_tables``: ``once`` (a tied table's lookups and logits served by one set of parts)
    or ``twice`` (a set of parts for each use)."""
    if tied_tables not in ("once", "twice"):
        raise ValueError(f"tied_tables is 'once' or 'twice', got {tied_tables!r}")

    splits: dict[str, Split] = {}
    for i, gnode in enumerate(nodes):
        found = over(i)
        op = gnode.node.operation
        if found is None or op.name in splits:
            continue
        need, text = found
        how = _kind(op)
        if how is None:
            raise refuse(op, text, budget_text, need)
        parts = parts_for(i, op, how)
        if parts is None:
            raise PlanError(
                f"layer {op.name!r} alone holds {text}, more than {budget_text}, and split into "
                f"any number of parts its activations and the device overhead are still over "
                f"the budget; raise the budget or lower --max-batch-size"
            )
        size = _size(op, how)
        tied = any(g.node.operation is op and reversed_call(g.node) for g in nodes)
        splits[op.name] = Split(
            op.name,
            type(op).__name__,
            how,
            size,
            bounds_for(size, parts),
            tied,
            held_once=tied and tied_tables == "once" and reads_own_rows(op),
        )
    pairs = find_pairs(nodes, outputs) if pair_dense else {}
    for first, (second, between, steps) in pairs.items():
        if first in splits and second in splits:
            a, b = splits[first], splits.pop(second)
            called = {g.node.operation.name: g.node for g in nodes}
            together = None if pair_parts is None else pair_parts(called[first], called[second])
            parts = max(a.parts, b.parts, together or 0)
            splits[first] = Split(
                first,
                f"{a.kind}+{b.kind}",
                "pair",
                a.size,
                bounds_for(a.size, parts),
                pair=second,
                between=between,
                steps=steps,
            )
    return list(splits.values())


# Layers that are the identity at inference: the hidden units pass through them part by part.
_IDENTITY_AT_INFERENCE = (
    "Dropout",
    "GaussianDropout",
    "AlphaDropout",
    "GaussianNoise",
    "SpatialDropout1D",
    "SpatialDropout2D",
    "SpatialDropout3D",
)


def _activation_name(fn: Any) -> str | None:
    """The name of an elementwise activation (``shards.split.layers.ELEMENTWISE_ACTIVATIONS``),
    else None."""
    from shards.split.layers import ELEMENTWISE_ACTIVATIONS

    try:
        name = keras.activations.serialize(fn)
    except (TypeError, ValueError):
        return None
    return name if isinstance(name, str) and name in ELEMENTWISE_ACTIVATIONS else None


def _step(op: Any) -> tuple[bool, str | None]:
    """Whether ``op`` acts on each hidden unit alone, and the activation it applies (None: the
    identity)."""
    if op.weights:
        return False, None
    kind = type(op).__name__
    if kind in _IDENTITY_AT_INFERENCE:
        return True, None
    if isinstance(op, keras.layers.Activation):
        name = _activation_name(op.activation)
        return name is not None, None if name == "linear" else name
    if isinstance(op, keras.layers.ReLU):
        plain = op.max_value is None and not op.negative_slope and not op.threshold
        return plain, "relu"
    return False, None


def _plain_dense(op: Any) -> bool:
    return (
        isinstance(op, keras.layers.Dense)
        and getattr(op, "quantization_mode", None) is None
        and getattr(op, "lora_enabled", False) is False
    )


def find_pairs(
    nodes: Sequence[Any], outputs: Sequence[Any]
) -> dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """Each ``Dense`` whose output feeds, through elementwise layers only (an activation,
    dropout), another ``Dense`` and nothing else: first layer -> (the second, the layers
    between, the activations applied to the hidden units in order). Each layer called once,
    no tensor between them a model output."""
    calls: dict[int, int] = {}
    readers: dict[int, list[Any]] = {}
    for gnode in nodes:
        node = gnode.node
        calls[id(node.operation)] = calls.get(id(node.operation), 0) + 1
        for tensor in {id(t): t for t in node.input_tensors}.values():
            readers.setdefault(id(tensor), []).append(node)
    ends = {id(t) for t in outputs}
    pairs: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {}
    for gnode in nodes:
        node, op = gnode.node, gnode.node.operation
        if not _plain_dense(op) or calls[id(op)] != 1:
            continue
        first = _activation_name(op.activation)
        if first is None:
            continue
        steps = [] if first == "linear" else [first]
        between: list[str] = []
        tensor = node.outputs[0]
        while id(tensor) not in ends and len(readers.get(id(tensor), ())) == 1:
            (reader,) = readers[id(tensor)]
            rop = reader.operation
            if calls[id(rop)] != 1 or len(reader.input_tensors) != 1:
                break
            if _plain_dense(rop):
                pairs[op.name] = (rop.name, tuple(between), tuple(steps))
                break
            ok, step = _step(rop)
            if not ok:
                break
            between.append(rop.name)
            if step is not None:
                steps.append(step)
            tensor = reader.outputs[0]
    return pairs


def describe(split: Split) -> str:
    if split.how == "pair":
        ranges = ", ".join(
            f"[{split.bounds[k]}, {split.bounds[k + 1]})" for k in range(split.parts)
        )
        return (
            f"{split.layer} and {split.pair} ({split.kind}) paired, split by the hidden units "
            f"into {split.parts}: {ranges} ({split.layer}'s output units, {split.pair}'s input "
            "units; only the partial sums cross)"
        )
    unit = "rows" if split.how == "rows" else "output units"
    ranges = ", ".join(f"[{split.bounds[k]}, {split.bounds[k + 1]})" for k in range(split.parts))
    held = ""
    if split.reversed:
        held = (
            ", each part's rows serving its logits too (held once)"
            if split.held_once
            else ", its rows held again for its logits"
        )
    text = f"{split.layer} ({split.kind}) split by {split.how} into {split.parts}: {unit} {ranges}"
    return text + held


__all__ = [
    "LOGITS",
    "SPLITTABLE",
    "Split",
    "bounds_for",
    "choose_splits",
    "describe",
    "find_pairs",
    "pair_parts_needed",
    "parts_needed",
    "reads_own_rows",
    "refuse",
    "reversed_call",
    "routes",
    "table_of",
    "token_and_position",
    "units_axis",
    "use_weight_bytes",
    "uses",
]
