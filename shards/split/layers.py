"""The layers a layer too large for one device becomes: its parts, and the combine that joins them.

An embedding table is split by rows (vocabulary ranges): ``TableRows`` holds one range and looks
up only the ids inside it, writing zeros for the others, so that adding the parts' outputs
(``SplitCombine(how="add")``) gives each row back exactly: every element is one part's value
plus zeros. A ``Dense`` or ``EinsumDense`` is split by its output units: ``KernelColumns``
holds a slice of the kernel (and of the bias) and computes those units without the activation;
``SplitCombine(how="concat")`` joins the slices along the output axis and applies the
activation, which may read the whole row (softmax). A tied table's logits (keras_hub's
``ReversibleEmbedding(..., reverse=True)``) are a ``KernelColumns`` too: its rows are the
columns of the logits' kernel (kept as rows, ``transposed``: ``x @ rows.T``, as the table
computes them), so one process can hold a part's rows once for both uses (``hold_rows_once``).

A part takes a list of inputs and returns one output per input: a layer called several times
(an id table read for a history and a candidate) is one part node serving every call, so its
rows are held once. Importing this module registers the layers, which every stage file holding
one needs before it loads (``shards.bundle.format.load_keras``).

Over 500 lines, one idea: the Keras layers a split layer is served as (each part, the pair, the
combine), which a stage file names and must register together; the rules that choose them live
in ``rule.py``, their weights' views in ``views.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from shards.sizes import itemsize, row_bytes
from shards.split.views import stored

# What a part's ``plan_row_bytes`` gets: each tensor it reads (its shape, batch axis first, and
# dtype), in call order.
Reads = Sequence[tuple[Sequence[Any], str]]


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


class _Part(keras.layers.Layer):  # type: ignore[misc]
    """A part layer: its weights written as Keras writes a layer's (in the same order, under
    the same keys), a view's slice handed over without a copy (``shards.split.views``)."""

    def save_own_variables(self, store: Any) -> None:
        weights = self._trainable_variables + self._non_trainable_variables
        for i, variable in enumerate(weights):
            store[f"{i}"] = stored(variable)


@keras.saving.register_keras_serializable(package="shardserve")
class TableRows(_Part):
    """Rows ``[start, start + rows)`` of an embedding table of ``output_dim`` columns and
    ``vocabulary`` rows in all.

    Each part reads every id as the whole table's lookup does (Keras's ``take``: a negative id
    counts from the end of the whole vocabulary) and checks it against the whole vocabulary,
    not only its own range: an id outside ``[0, vocabulary)`` then raises
    ``InvalidArgumentError`` as the whole table's lookup does on a CPU, so the bad row is
    isolated and answered with its reason rather than given zeros. The check is the parts', not
    the combine's: every part reads the ids (the combine reads them only for ``mask_zero``), it
    fails the batch at the stage where the whole model would, and a combine done by the driver
    (a model output) runs no TensorFlow. On a GPU, where the whole table's lookup gives zeros
    for such an id, a split table is the stricter of the two.

    ``routed``: the part returns only what it made, per input two outputs: the vectors of the
    ids inside its range (``[found, output_dim]``) and their positions in the ids read flat
    (``[found]``, int32), which ``SplitCombine(how="scatter")`` puts in place; the dense way
    (the whole output, zeros outside its rows) writes every part ``parts`` times as much.

    Every part gets all the ids, not only those in its range, by measure (``python -m
    bench.split_ids``, issue 42): the driver puts a request tensor in the object store once
    and every part reads that copy, so for a batch of 32 x 21 ids the driver writes 2.6 KiB and
    2 parts read 5.2 KiB; split by range, the driver would write each part its ids and their
    positions (5.2 KiB, twice as much) and the parts read as much as now (equal at 2 parts,
    4 bytes an id less per part beyond), against the 86.6 KiB the routed parts write. The
    driver's split costs the front end ~0.1 ms of numpy a batch, a part looking up only its
    own ids was no faster (1.03-1.19x the time of all of them, under load), and the
    out-of-vocabulary check would leave TensorFlow for the driver.
    """

    def __init__(
        self,
        start: int,
        rows: int,
        output_dim: int,
        vocabulary: int | None = None,
        routed: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.start, self.rows, self.output_dim = int(start), int(rows), int(output_dim)
        self.vocabulary = None if vocabulary is None else int(vocabulary)
        self.routed = bool(routed)

    def build(self, input_shape: Any) -> None:
        self.embeddings = self.add_weight(
            shape=(self.rows, self.output_dim), initializer="zeros", name="embeddings"
        )

    def call(self, inputs: Any) -> list[Any]:
        outputs = []
        for ids in _as_list(inputs):
            if ids.dtype not in ("int32", "int64"):
                ids = ops.cast(ids, "int32")
            if self.vocabulary is not None:
                # As Keras's take: a negative id counts from the end of the whole vocabulary.
                ids = ops.where(ids < 0, ids + self.vocabulary, ids)
                check_ids(ids, self.vocabulary)
            local = ids - self.start
            inside = ops.logical_and(local >= 0, local < self.rows)
            if self.routed:
                outputs.extend(self._routed(local, inside))
                continue
            found = ops.take(self.embeddings, ops.where(inside, local, 0), axis=0)
            found = ops.where(ops.expand_dims(inside, -1), found, ops.zeros_like(found))
            outputs.append(ops.cast(found, self.compute_dtype))
        return outputs

    def _routed(self, local: Any, inside: Any) -> list[Any]:
        """Only the rows this part holds: their vectors ``[found, output_dim]`` and their
        positions ``[found]`` in the ids read flat (row-major), for the combine to scatter."""
        flat_local = ops.reshape(local, (-1,))
        positions = ops.cast(ops.nonzero(ops.reshape(inside, (-1,)))[0], "int32")
        found = ops.take(self.embeddings, ops.take(flat_local, positions), axis=0)
        return [ops.cast(found, self.compute_dtype), positions]

    def plan_row_bytes(self, reads: Reads, sequence_length: int) -> tuple[list[int] | None, int]:
        """What the memory plan counts per batch row (``shards.partition.memory_plan``): each
        output's bytes (None: as its shape says) and the bytes held inside the call. Routed,
        the rows found have no bound of their own but the batch's ids: a part may hold every
        id of the batch (all in its range), so each call's vectors are counted at one per id,
        as the dense output, and its positions at 4 bytes an id."""
        if not self.routed:
            return None, 0
        sizes: list[int] = []
        for shape, _ in reads:
            ids = row_bytes(shape, "uint8", sequence_length)[0]  # one byte a cell: the count
            sizes += [ids * self.output_dim * itemsize(self.compute_dtype), ids * 4]
        return sizes, 0

    def compute_output_shape(self, input_shape: Any) -> list[tuple[Any, ...]]:
        shapes = input_shape if isinstance(input_shape, list) else [input_shape]
        if self.routed:
            return [shape for _ in shapes for shape in ((None, self.output_dim), (None,))]
        return [(*tuple(s), self.output_dim) for s in shapes]

    def compute_output_spec(self, inputs: Any) -> list[Any]:
        if not self.routed:
            return super().compute_output_spec(inputs)
        specs = []
        for _ in _as_list(inputs):
            specs.append(keras.KerasTensor((None, self.output_dim), dtype=self.compute_dtype))
            specs.append(keras.KerasTensor((None,), dtype="int32"))
        return specs

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return None

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "start": self.start,
            "rows": self.rows,
            "output_dim": self.output_dim,
            "vocabulary": self.vocabulary,
            "routed": self.routed,
        }


def check_ids(ids: Any, vocabulary: int) -> None:
    """Raise ``InvalidArgumentError`` naming the first id outside ``[0, vocabulary)``, in the
    words of TensorFlow's own gather (``indices[2,0] = 7000 is not in [0, 6000)``)."""
    import tensorflow as tf

    bad = tf.logical_or(ids < 0, ids >= vocabulary)

    def fail() -> Any:
        at = tf.where(bad)[0]
        where = tf.strings.reduce_join(tf.strings.as_string(at), separator=",")
        value = tf.strings.as_string(tf.gather_nd(ids, at[None])[0])
        text = tf.strings.join(["indices[", where, "] = ", value, f" is not in [0, {vocabulary})"])
        return tf.raw_ops.Assert(condition=False, data=[text])

    # Assert inside the branch taken only on a bad id: a clean batch pays one comparison.
    tf.cond(tf.reduce_any(bad), fail, tf.no_op)


def einsum_letters(equation: str, ranks: Sequence[int]) -> tuple[list[str], str]:
    """The subscripts of an einsum's operands and output, ``...`` written out as digits for the
    ``ranks`` of the operands (the first operand's rank fixes how many axes it stands for)."""
    operands, output = equation.split("->")
    specs = operands.split(",")
    extra = ""
    for spec, rank in zip(specs, ranks, strict=True):
        if "..." in spec:
            extra = "".join(str(d) for d in range(rank - (len(spec) - 3)))
            break
    return [s.replace("...", extra) for s in specs], output.replace("...", extra)


@keras.saving.register_keras_serializable(package="shardserve")
class KernelColumns(_Part):
    """A slice of a ``Dense`` (``equation=None``: ``x @ kernel + bias``, as Dense computes it) or
    ``EinsumDense`` kernel along its output units, without the activation. ``transposed``: the
    kernel is held as ``[units, inputs]`` and read as ``x @ kernel.T`` (a tied table's rows,
    as ``ReversibleEmbedding`` computes its logits; no equation, no bias)."""

    def __init__(
        self,
        kernel_shape: Sequence[int],
        bias_shape: Sequence[int] | None,
        equation: str | None = None,
        transposed: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.kernel_shape = tuple(int(d) for d in kernel_shape)
        self.bias_shape = None if bias_shape is None else tuple(int(d) for d in bias_shape)
        self.equation = equation
        self.transposed = bool(transposed)
        if self.transposed and (equation is not None or bias_shape is not None):
            raise ValueError("a transposed KernelColumns has no equation and no bias")
        self.supports_masking = True

    def build(self, input_shape: Any) -> None:
        self.kernel = self.add_weight(shape=self.kernel_shape, initializer="zeros", name="kernel")
        self.bias = None
        if self.bias_shape is not None:
            self.bias = self.add_weight(shape=self.bias_shape, initializer="zeros", name="bias")

    def call(self, inputs: Any) -> list[Any]:
        outputs = []
        for x in _as_list(inputs):
            if self.transposed:
                y = ops.matmul(x, ops.transpose(self.kernel))
            elif self.equation is None:
                y = ops.matmul(x, self.kernel)
            else:
                y = ops.einsum(self.equation, x, self.kernel)
            outputs.append(y if self.bias is None else ops.add(y, self.bias))
        return outputs

    def _shape(self, shape: Sequence[Any]) -> tuple[Any, ...]:
        if self.transposed:
            return (*tuple(shape)[:-1], self.kernel_shape[0])
        if self.equation is None:
            return (*tuple(shape)[:-1], self.kernel_shape[-1])
        (x, k), out = einsum_letters(self.equation, [len(shape), len(self.kernel_shape)])
        dims = dict(zip(x, shape, strict=True)) | dict(zip(k, self.kernel_shape, strict=True))
        return tuple(dims[c] for c in out)

    def compute_output_shape(self, input_shape: Any) -> list[tuple[Any, ...]]:
        shapes = input_shape if isinstance(input_shape, list) else [input_shape]
        return [self._shape(s) for s in shapes]

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return mask

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "kernel_shape": list(self.kernel_shape),
            "bias_shape": None if self.bias_shape is None else list(self.bias_shape),
            "equation": self.equation,
            "transposed": self.transposed,
        }


def hold_rows_once(guest: keras.Model, host: keras.Model) -> int:
    """Make each tied table's logits part in ``guest`` (a ``transposed`` ``KernelColumns``)
    read the rows of the lookup part in ``host`` (a ``TableRows`` of the same shape): one
    variable for both uses, the guest's own copy dropped. The bytes it held (its copy is freed
    once nothing else refers to it). ``ValueError`` where a logits part has no such rows."""
    tables = [layer for layer in host.layers if isinstance(layer, TableRows)]
    freed = 0
    for layer in guest.layers:
        if not (isinstance(layer, KernelColumns) and layer.transposed):
            continue
        shape = tuple(layer.kernel.shape)
        found = [t for t in tables if tuple(t.embeddings.shape) == shape]
        if len(found) != 1:
            raise ValueError(
                f"{layer.name!r} reads {shape} rows; the host stage has {len(found)} table "
                "part(s) of that shape"
            )
        rows, own = found[0].embeddings, layer.kernel
        if str(rows.dtype) != str(own.dtype):
            raise ValueError(f"{layer.name!r} is {own.dtype}; its rows are {rows.dtype}")
        freed += math.prod(shape) * np.dtype(str(own.dtype)).itemsize
        # Keras tracks a layer's variables in these lists: the own copy leaves them, and the
        # attribute set (tracked) is the host's rows.
        layer._tracker.unlock()
        for tracked in (layer._trainable_variables, layer._non_trainable_variables):
            if any(v is own for v in tracked):
                tracked[:] = [v for v in tracked if v is not own]
        layer.kernel = rows
        layer._tracker.lock()
        del own
    return freed


# Activations that act on each element alone: the hidden units between a column-split and a
# row-split Dense may pass through them part by part (softmax reads the whole row: it may not).
ELEMENTWISE_ACTIVATIONS = frozenset(
    {
        "linear",
        "relu",
        "relu6",
        "leaky_relu",
        "gelu",
        "tanh",
        "sigmoid",
        "hard_sigmoid",
        "silu",
        "swish",
        "hard_silu",
        "hard_swish",
        "elu",
        "selu",
        "softplus",
        "softsign",
        "mish",
        "exponential",
        "celu",
    }
)


@keras.saving.register_keras_serializable(package="shardserve")
class PairedSlices(_Part):
    """Part k of a column-split ``Dense`` and of the row-split ``Dense`` its output feeds
    (Megatron's column- then row-parallel pair): ``x @ kernel_in[:, a:b] + bias_in[a:b]``, then
    the elementwise ``steps`` (activations, serialised; dropout is the identity at inference),
    then that slice of the hidden units times ``kernel_out[a:b, :]``: this part's partial
    product of the second layer's output. The parts' partial products summed are the second
    layer's output before its bias; ``bias_out`` is added by part 0 only, so the sum holds it
    once. The hidden activation never leaves the part."""

    def __init__(
        self,
        kernel_in_shape: Sequence[int],
        bias_in: bool,
        kernel_out_shape: Sequence[int],
        bias_out: bool,
        steps: Sequence[Any] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.kernel_in_shape = tuple(int(d) for d in kernel_in_shape)
        self.kernel_out_shape = tuple(int(d) for d in kernel_out_shape)
        self.has_bias_in, self.has_bias_out = bool(bias_in), bool(bias_out)
        self.steps = [keras.activations.get(s) for s in steps]
        self.supports_masking = True

    def build(self, input_shape: Any) -> None:
        self.kernel_in = self.add_weight(
            shape=self.kernel_in_shape, initializer="zeros", name="kernel_in"
        )
        self.bias_in = None
        if self.has_bias_in:
            self.bias_in = self.add_weight(
                shape=self.kernel_in_shape[-1:], initializer="zeros", name="bias_in"
            )
        self.kernel_out = self.add_weight(
            shape=self.kernel_out_shape, initializer="zeros", name="kernel_out"
        )
        self.bias_out = None
        if self.has_bias_out:
            self.bias_out = self.add_weight(
                shape=self.kernel_out_shape[-1:], initializer="zeros", name="bias_out"
            )

    def call(self, inputs: Any) -> list[Any]:
        outputs = []
        for x in _as_list(inputs):
            hidden = ops.matmul(x, self.kernel_in)
            if self.bias_in is not None:
                hidden = ops.add(hidden, self.bias_in)
            for step in self.steps:
                hidden = step(hidden)
            y = ops.matmul(hidden, self.kernel_out)
            outputs.append(y if self.bias_out is None else ops.add(y, self.bias_out))
        return outputs

    def plan_row_bytes(self, reads: Reads, sequence_length: int) -> tuple[list[int] | None, int]:
        """What the memory plan counts per batch row beyond the outputs' shapes: the slice of
        the hidden activation (``[..., units]`` of the first layer, this part's units) that
        lives inside the call and never leaves it."""
        units = self.kernel_in_shape[-1]
        item = itemsize(self.compute_dtype)
        hidden = sum(
            row_bytes((*tuple(shape)[:-1], units), "uint8", sequence_length)[0] * item
            for shape, _ in reads
        )
        return None, hidden

    def compute_output_shape(self, input_shape: Any) -> list[tuple[Any, ...]]:
        shapes = input_shape if isinstance(input_shape, list) else [input_shape]
        return [(*tuple(s)[:-1], self.kernel_out_shape[-1]) for s in shapes]

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return mask

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "kernel_in_shape": list(self.kernel_in_shape),
            "bias_in": self.has_bias_in,
            "kernel_out_shape": list(self.kernel_out_shape),
            "bias_out": self.has_bias_out,
            "steps": [keras.activations.serialize(s) for s in self.steps],
        }


@keras.saving.register_keras_serializable(package="shardserve")
class SplitCombine(keras.layers.Layer):  # type: ignore[misc]
    """The parts' outputs joined: added (row ranges; with ``mask_zero`` the ids come first and
    the output carries ``ids != 0`` as its mask, as the table's ``Embedding`` did; ``extra``
    inputs after the parts are added to their sum: a TokenAndPositionEmbedding's positions; a
    paired split's partial products, then the second layer's ``activation``), scattered
    (``how="scatter"``: routed row ranges, the ids first, then each part's vectors and their
    positions, ``TableRows(routed=True)``; exact as the add), or
    concatenated along ``axis`` and passed through ``activation`` and ``soft_cap`` (column
    ranges; a tied table's logits)."""

    def __init__(
        self,
        how: str,
        axis: int = -1,
        activation: Any = None,
        mask_zero: bool = False,
        soft_cap: float | None = None,
        extra: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.extra = int(extra)
        self.how, self.axis, self.mask_zero = how, int(axis), bool(mask_zero)
        self.soft_cap = None if soft_cap is None else float(soft_cap)
        self.activation = keras.activations.get(activation)
        self.supports_masking = True

    def _parts(self, inputs: Any) -> list[Any]:
        parts = _as_list(inputs)
        parts = parts[1:] if self.mask_zero or self.how == "scatter" else parts
        return parts[: len(parts) - self.extra]

    def _scatter(self, inputs: Any) -> Any:
        """The routed parts' vectors put at their positions: every position is one part's
        (the ranges do not overlap), so the output is the dense one exactly."""
        ids, parts = _as_list(inputs)[0], self._parts(inputs)
        dim = parts[0].shape[-1]
        values = ops.concatenate(parts[0::2], axis=0)
        positions = ops.expand_dims(ops.concatenate(parts[1::2], axis=0), -1)
        flat = ops.scatter(positions, values, (ops.size(ids), dim))
        return ops.reshape(flat, (*ops.shape(ids), dim))

    def call(self, inputs: Any) -> Any:
        parts = self._parts(inputs)
        if self.how == "scatter":
            joined = ops.cast(self._scatter(inputs), self.compute_dtype)
            for addend in _as_list(inputs)[len(_as_list(inputs)) - self.extra :]:
                joined = ops.add(joined, addend)
            return joined
        if self.how == "add":
            # Each element is one part's value and zeros from the others: the sum is exact.
            joined = functools.reduce(ops.add, parts)
            # Then what the layer added to its lookup (a TokenAndPositionEmbedding's positions).
            for addend in _as_list(inputs)[len(_as_list(inputs)) - self.extra :]:
                joined = ops.add(joined, addend)
            # A paired split's second layer: its activation after the partial products' sum.
            return self.activation(joined)
        joined = self.activation(ops.concatenate(parts, axis=self.axis))
        if self.soft_cap is not None:
            # A ReversibleEmbedding's logit_soft_cap, on the joined logits as on its own.
            joined = ops.multiply(ops.tanh(ops.divide(joined, self.soft_cap)), self.soft_cap)
        return joined

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        shapes = [tuple(s) for s in self._parts(input_shape)]
        if self.how == "scatter":
            return (*tuple(_as_list(input_shape)[0]), shapes[0][-1])
        if self.how == "add":
            return shapes[0]
        axis = self.axis % len(shapes[0])
        dims = [s[axis] for s in shapes]
        joined = None if any(d is None for d in dims) else sum(dims)
        return (*shapes[0][:axis], joined, *shapes[0][axis + 1 :])

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        if self.mask_zero:
            return ops.not_equal(_as_list(inputs)[0], 0)
        masks = _as_list(mask)
        return masks[0] if masks else None

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "how": self.how,
            "axis": self.axis,
            "activation": keras.activations.serialize(self.activation),
            "mask_zero": self.mask_zero,
            "soft_cap": self.soft_cap,
            "extra": self.extra,
        }
