"""Whether a model may be length padded, asked once at warm-up.

Rows of different lengths share a batch only when every input of unknown length can be padded:
the model masks it (its ``TensorSpec.pad_value``, found when the model was cut) or the user named
a pad value for it (``--pad-input NAME=VALUE``). Which outputs follow the length is found by
running one row at two lengths. Then the check that padding is safe for this model: rows of
lengths 1, 7, a bucket minus one, run alone and padded to a longer bucket (a short row also to
the longest), each output cut back and compared with the row alone. Any difference over 1e-5 of
the output's largest value turns length padding off for the model, with the reason in the log
and the metadata; its requests then queue by length, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving.batching.lengths import LengthPadding, length_buckets
from serving.settings.config import ConfigError, Settings
from serving.settings.lengths import served_max_length
from serving.version.runner import ModelRunner
from shards.errors import one_line
from shards.signature import ModelSignature, TensorSpec

__all__ = ["RELATIVE_TOLERANCE", "LengthPlan", "plan_length_padding", "probe_row"]

log = logging.getLogger("shardserve")

RELATIVE_TOLERANCE = 1e-5  # of an output's largest value
# An output of zeros alone would make any difference "too large"; below this it is noise.
_SCALE_FLOOR = 1e-12
# The two lengths the output axes are found with: an output dimension equal to both follows the
# length (one length alone could equal a fixed dimension by chance).
_AXIS_LENGTHS = (5, 9)
_SEED = 19


@dataclass(frozen=True)
class LengthPlan:
    """The length padding in force for a model (``padding``), or why none (``reason``)."""

    padding: LengthPadding | None
    reason: str
    applies: bool = True  # False: the model takes no input of unknown length

    def parameters(self) -> dict[str, Any] | None:
        """What the V2 model metadata says of it; ``None`` where it does not apply."""
        if not self.applies:
            return None
        if self.padding is None:
            return {"off": self.reason}
        return {
            "inputs": sorted(self.padding.axes),
            "buckets": list(self.padding.buckets),
            "outputs_cut_back": sorted(self.padding.output_axes),
        }


async def plan_length_padding(runner: ModelRunner, settings: Settings) -> LengthPlan:
    """The length padding to serve ``runner``'s model with, checked by running it; logged.

    ``ConfigError`` when ``--pad-input`` names an input that cannot be length padded."""
    signature = runner.signature
    pad_values = _pad_values(signature, settings.pad_inputs)
    if not any(None in spec.shape for spec in signature.inputs):
        return LengthPlan(None, "the model takes no input of unknown length", applies=False)
    if not settings.pad_lengths:
        return _off("turned off by --no-pad-lengths", logging.INFO)
    unpadded = [s.name for s in signature.inputs if None in s.shape and s.name not in pad_values]
    if unpadded:
        return _off(
            f"inputs {unpadded} have an unknown length but no pad value (the model does not "
            "mask them, and no --pad-input NAME=VALUE names them)",
            logging.INFO,
        )
    allowed = tuple(settings.allowed_lengths) if settings.allowed_lengths else None
    buckets = length_buckets(served_max_length(settings.max_sequence_length, signature), allowed)
    if buckets[-1] < 2:
        return _off(f"every row has one length (max_sequence_length={buckets[-1]})", logging.INFO)
    axes = {
        spec.name: spec.shape.index(None) + 1 for spec in signature.inputs if None in spec.shape
    }
    try:
        output_axes = await _output_axes(runner, pad_values, buckets[-1])
        padding = LengthPadding(axes, pad_values, buckets, output_axes)
        unsafe = await _first_difference(runner, padding)
    except Exception as exc:  # a model that fails the check is served unpadded
        return _off(f"the warm-up check of length padding failed: {one_line(exc)}")
    if unsafe is not None:
        return _off(f"padding changes this model's answers: {unsafe}")
    log.info(
        "length padding on for inputs %s along their length, buckets %s, outputs cut back: %s",
        sorted(axes),
        list(buckets),
        sorted(output_axes),
    )
    return LengthPlan(padding, "on")


def _off(reason: str, level: int = logging.WARNING) -> LengthPlan:
    log.log(level, "length padding off: %s; rows of different lengths queue apart", reason)
    return LengthPlan(None, reason)


def _pad_values(signature: ModelSignature, given: Mapping[str, Any]) -> dict[str, Any]:
    """Each input that may be length padded and its pad value: the model's own (its mask's),
    or the one ``--pad-input`` gives."""
    qualify = [spec.name for spec in signature.inputs if spec.shape.count(None) == 1]
    bad = sorted(name for name in given if name not in qualify)
    if bad:
        raise ConfigError(
            f"--pad-input names {bad}, which this model does not take with exactly one unknown "
            f"dimension; inputs that can be length padded: {qualify}"
        )
    values: dict[str, Any] = {}
    for spec in signature.inputs:
        if spec.name in given:
            values[spec.name] = given[spec.name]
        elif spec.pad_value is not None and spec.name in qualify:
            values[spec.name] = spec.pad_value
    return values


def probe_row(
    signature: ModelSignature, length: int, pad_values: Mapping[str, Any], padded_to: int = 0
) -> dict[str, np.ndarray]:
    """One row (batch of 1) of ``length`` positions, the same for the same arguments; padded
    with each input's pad value up to ``padded_to``."""
    rng = np.random.default_rng(_SEED)
    row = {}
    for spec in signature.inputs:
        shape = (1, *(length if d is None else d for d in spec.shape))
        array = _probe_values(spec, shape, rng)
        if padded_to > length and spec.name in pad_values:
            axis = spec.shape.index(None) + 1
            widths = [(0, 0)] * array.ndim
            widths[axis] = (0, padded_to - length)
            fill = np.array(pad_values[spec.name], dtype=array.dtype)
            array = np.pad(array, widths, constant_values=fill)
        row[spec.name] = array
    return row


def _probe_values(spec: TensorSpec, shape: tuple[int, ...], rng: np.random.Generator) -> Any:
    dtype = spec.np_dtype
    name = spec.name.lower()
    if dtype == np.bool_ or "mask" in name:  # a padding mask: every real position counts
        return np.ones(shape, dtype=dtype)
    if np.issubdtype(dtype, np.integer):
        # Token ids: small ones fit any vocabulary; segment / type ids index 2 embeddings.
        high = 2 if "segment" in name or "type" in name else 10
        return rng.integers(0 if high == 2 else 1, high, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


async def _output_axes(
    runner: ModelRunner, pad_values: Mapping[str, Any], max_length: int
) -> dict[str, int]:
    """Each output's array axis that equals the row's length at both probe lengths."""
    short, long = (min(n, max_length - 1 + i) for i, n in enumerate(_AXIS_LENGTHS))
    signature = runner.signature
    first = await runner.run_batch(probe_row(signature, short, pad_values))
    second = await runner.run_batch(probe_row(signature, long, pad_values))
    axes = {}
    for spec in signature.outputs:
        a, b = np.shape(first[spec.name]), np.shape(second[spec.name])
        unknown = [i + 1 for i, d in enumerate(spec.shape) if d is None]
        follows = [i for i in unknown if i < min(len(a), len(b)) and (a[i], b[i]) == (short, long)]
        if follows:
            axes[spec.name] = follows[0]
    return axes


def _probe_pairs(buckets: tuple[int, ...]) -> list[tuple[int, int]]:
    """(length, padded length) pairs: rows of 1 and 7 and a bucket minus one, each padded to
    the next bucket above it, and a short row padded to the longest."""
    longest = buckets[-1]

    def above(n: int) -> int:
        return next(b for b in buckets if b > n)

    bucket_less_one = next((b - 1 for b in buckets if b - 1 not in (0, 1, 7)), 1)
    pairs = {(n, above(n)) for n in (1, 7, bucket_less_one) if n < longest}
    pairs.add((min(7, longest - 1), longest))
    return sorted(pairs)


async def _first_difference(runner: ModelRunner, padding: LengthPadding) -> str | None:
    """Where padding changes an answer (the output, the lengths, the difference); ``None``
    when no output of any probe pair differs by more than the tolerance."""
    signature = runner.signature
    pad_values = dict(padding.pad_values)
    alone: dict[int, dict[str, np.ndarray]] = {}
    for length, padded_to in _probe_pairs(padding.buckets):
        if length not in alone:
            alone[length] = await runner.run_batch(probe_row(signature, length, pad_values))
        padded = await runner.run_batch(probe_row(signature, length, pad_values, padded_to))
        cut = padding.cut(padded, length)
        for name, want in alone[length].items():
            got = cut.get(name)
            where = f"output {name!r} of a row of length {length} padded to {padded_to}"
            if got is None or np.shape(got) != np.shape(want):
                shape = None if got is None else np.shape(got)
                return f"{where} has shape {shape}, alone {np.shape(want)}"
            difference = _difference(np.asarray(got), np.asarray(want))
            scale = max(float(np.max(np.abs(want), initial=0.0)), _SCALE_FLOOR)
            if not difference <= RELATIVE_TOLERANCE * scale:
                return (
                    f"{where} differs from the row alone by {difference:.3g} "
                    f"(over {RELATIVE_TOLERANCE:g} of its largest value, {scale:.3g})"
                )
    return None


def _difference(got: np.ndarray, want: np.ndarray) -> float:
    if got.size == 0:
        return 0.0
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
