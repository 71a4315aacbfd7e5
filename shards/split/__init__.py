"""Split layers: a layer too large for one device, held by several.

Read this first. The planner (``shards.partition``) cuts a model between layers, each stage on
one device. A layer whose weights plus activations at the max batch exceed the device budget
cannot be one stage; it is split instead, and this package is everything about that:

- **The kinds** (``shards.split.rule``): ``Embedding`` (``mask_zero`` too), keras_hub's
  ``ReversibleEmbedding`` and the token table of its ``TokenAndPositionEmbedding`` split by
  *rows* (each part a vocabulary range); ``Dense`` and ``EinsumDense`` split by *columns*
  (output units); a tied table's logits (``ReversibleEmbedding(..., reverse=True)``) split at
  the same rows as its lookups, each part its columns of the logits (from the rows as they
  are, read transposed: ``KernelColumns(transposed=True)``). Two ``Dense`` layers both
  too large, the first feeding the second through elementwise layers only (an activation,
  dropout), are a *pair* (``find_pairs``; Megatron's column- then row-parallel layers): part k
  holds the first's output units and the second's input units ``[a, b)``, keeps its slice of the
  hidden activation, and sends only its partial product of the second's output; the combine
  sums them (the second bias held by part 0 alone, so added once) and applies the second's
  activation. The sum reorders the second layer's additions: equal to 1e-5 relative
  (``partition_to_bundle(..., pair_dense=False)`` splits each alone, by columns: the split
  bench's unpaired layout, not a user setting). Any other
  kind too large is refused by name, with its size, the budget and the kinds that can be split;
  a quantized (int8) layer too large is refused at plan time by name (its scale is not split).
- **The plan rule** (``choose_splits``, ``parts_needed``): the fewest parts whose slice of the
  weights plus the activations each part holds and writes, at the max batch, plus the device
  overhead, fit the largest budget. By rows every part writes the whole output (zeros outside
  its rows), routed at worst the same (every id of the batch in its range) plus 4 bytes an id
  of position; by columns its share; a pair's part (``pair_parts_needed``) both layers' share,
  the second's whole output and its slice of the hidden activation. The memory model of the
  rewritten graph counts the same: a part says what its shapes do not (``plan_row_bytes``: a
  routed part's rows found at their worst case, a pair's hidden slice inside its call). Each
  use is charged the matrix it reads (``use_weight_bytes``: an untied table's logits its
  reverse table, its lookups its table).
  A tied table is split once and **held once** (``tied_tables="once"``, the default): part
  k's lookup stage and its logits stage keep their places in the pipeline (the depth is
  unchanged), but the logits part is marked ``held_by`` the lookup part's stage
  (``StagePart.held_by``, ``hosts``, ``Manifest.hosts``): one actor, one device, runs both,
  its logits reading the lookup's rows (``hold_rows_once``: one copy in the process), in a Ray
  concurrency group of their own (``GUEST_GROUP``) so that batch n+1's lookup does not wait
  behind batch n's logits (Ray runs one group's calls in order). The rule charges such a part
  its rows once and both uses' activations (``parts_needed(..., beside=...)``;
  ``Manifest.actor_peak_bytes``). ``tied_tables="twice"`` keeps a set of parts for each use.
- **The parts** (``shards.split.layers``): ``TableRows`` (a range of a table's rows, zeros for
  ids outside it), ``KernelColumns`` (a slice of a kernel's output units, no activation),
  ``PairedSlices`` (part k of a pair).
- **The parts' weights** (``shards.split.views``): views of the layer's, not copies. Each part's
  variables are built holding no value, their value read out of the layer's slice whenever it is
  asked for and kept by no one: traced (planning, cutting the stages) a slice op on the layer's
  variable; run, the slice itself. The partitioner writes the stages one after another, a part
  handing its slice to Keras's weight store as the store's own, so it holds the model plus one
  part's slice at most (a range of a table's rows is written out of the table's own buffer: no
  copy at all; a range of columns is one copy), and a stage file is written through a file
  beside it, not in memory (``shards.partition.cut``).
- **The combine**: the parts' outputs joined per call of the layer, a ``SplitCombine`` layer at
  the start of the stage that reads the layer's output (an add for rows: exact, every element
  is one part's value plus zeros; a concatenation then the activation for columns: 1e-6
  relative), or, where the output is a model output and numpy computes it as Keras does, by
  the driver (``DriverCombine``, planned against ``driver_join_max_bytes``). A table split by
  rows is joined *routed* by default (``lookup_combine``, the knob's one owner
  ``shards.split.lookup``: the server's setting, ``partition``/``plan``'s flag): each
  ``TableRows`` part writes only the vectors of the ids in its range and their positions, and
  ``SplitCombine(how="scatter")`` puts them in place (exact, as the add); a part then writes
  ~1/parts of the dense output. ``dense`` keeps the add. The dense add stays where routing does
  not apply (``routes``): a lookup that is a model output (the driver's numpy add), a
  TokenAndPositionEmbedding's token table, and a tied table's logits (columns).
- **The rewrite** (``split_model``, ``hand_to_driver``): the model with each split layer's
  calls replaced by one call of each part and a combine per call; the planner then gives each
  part a stage of its own.
- **What the pipeline needs to know** (``shards.split.parts``): which part a stage holds
  (``StagePart``, in the manifest), the stages' places ("3.0", "3.1": parts side by side), the
  pipeline's depth (``pipeline_depth``: the parts of one layer count once), which the
  manifest exposes as ``Manifest.depth`` and every consumer reads, and which stage's actor
  runs each stage (``hosts``: an actor per host, ``Manifest.actors``).

The interface is this module: other code imports ``shards.split`` and nothing below it, but
``shards.split.lookup`` (the knob's choices), which the settings import without this module's
names (its type-checking imports would chain them to Keras for import-linter). The
numpy names (the parts, the places, the driver's combine) import no TensorFlow or Keras; the
Keras names (the rule, the rewrite, the layers) are imported on first use, so the server can
read a manifest without TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shards.split.combine import (
    DriverCombine,
    check_join_budget,
    combine_outputs,
    join_bytes,
    join_row_bytes,
)
from shards.split.lookup import (
    DEFAULT_LOOKUP_COMBINE,
    LOOKUP_COMBINES,
    LookupCombine,
    check_lookup_combine,
)
from shards.split.parts import (
    GUEST_GROUP,
    StagePart,
    hosts,
    pipeline_depth,
    place_labels,
    places,
)

if TYPE_CHECKING:
    from shards.split.layers import (
        KernelColumns,
        PairedSlices,
        SplitCombine,
        TableRows,
        hold_rows_once,
    )
    from shards.split.rewrite import hand_to_driver, split_model
    from shards.split.rule import (
        LOGITS,
        SPLITTABLE,
        Split,
        bounds_for,
        choose_splits,
        describe,
        find_pairs,
        pair_parts_needed,
        parts_needed,
        reads_own_rows,
        refuse,
        routes,
        use_weight_bytes,
        uses,
    )

# The names that need Keras, by the module that holds them: imported on first use.
_KERAS = {
    "KernelColumns": "layers",
    "PairedSlices": "layers",
    "SplitCombine": "layers",
    "TableRows": "layers",
    "hand_to_driver": "rewrite",
    "hold_rows_once": "layers",
    "split_model": "rewrite",
    "LOGITS": "rule",
    "SPLITTABLE": "rule",
    "Split": "rule",
    "bounds_for": "rule",
    "choose_splits": "rule",
    "describe": "rule",
    "find_pairs": "rule",
    "use_weight_bytes": "rule",
    "pair_parts_needed": "rule",
    "reads_own_rows": "rule",
    "parts_needed": "rule",
    "refuse": "rule",
    "routes": "rule",
    "uses": "rule",
}


def __getattr__(name: str) -> Any:
    if name in _KERAS:
        return getattr(importlib.import_module(f"shards.split.{_KERAS[name]}"), name)
    raise AttributeError(f"module 'shards.split' has no attribute {name!r}")


def register_layers() -> None:
    """Register the parts' Keras layers, which a stage file holding one needs before it loads
    (``shards.bundle.format.load_keras``)."""
    importlib.import_module("shards.split.layers")


__all__ = [
    "DEFAULT_LOOKUP_COMBINE",
    "GUEST_GROUP",
    "LOGITS",
    "LOOKUP_COMBINES",
    "SPLITTABLE",
    "DriverCombine",
    "KernelColumns",
    "LookupCombine",
    "PairedSlices",
    "Split",
    "SplitCombine",
    "StagePart",
    "TableRows",
    "bounds_for",
    "check_join_budget",
    "check_lookup_combine",
    "choose_splits",
    "combine_outputs",
    "describe",
    "find_pairs",
    "hand_to_driver",
    "hold_rows_once",
    "hosts",
    "join_bytes",
    "join_row_bytes",
    "pair_parts_needed",
    "parts_needed",
    "pipeline_depth",
    "place_labels",
    "places",
    "reads_own_rows",
    "refuse",
    "register_layers",
    "routes",
    "split_model",
    "use_weight_bytes",
    "uses",
]
