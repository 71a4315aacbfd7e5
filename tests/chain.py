"""A bundle's stages run one after the other in this process, each loaded on its own, the way
the pipeline routes tensors by name: what the partitioner's tests compare with the whole model
(the pipeline itself runs them in Ray actors: ``shards.pipeline``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import keras
import numpy as np

from shards.bundle.format import load_stage, read_manifest
from shards.split import combine_outputs


def run_chain(
    bundle_dir: str | Path,
    inputs: Mapping[str, np.ndarray],
    imports: Sequence[str] = (),
    *,
    unsafe_deserialization: bool = False,
) -> dict[str, np.ndarray]:
    """Run a bundle's stages one after the other, each loaded on its own, routing every tensor
    by name from wherever it was produced (a model input or an earlier stage's output)."""
    manifest = read_manifest(bundle_dir)
    tensors: dict[str, np.ndarray] = dict(inputs)
    for spec in manifest.stages:
        stage = load_stage(
            bundle_dir,
            spec.index,
            imports or manifest.imports,
            unsafe_deserialization=unsafe_deserialization,
        )
        args = [tensors[t.name] for t in spec.inputs]
        result = stage(args[0] if len(args) == 1 else args, training=False)
        results = result if isinstance(result, list | tuple) else [result]
        for t, value in zip(spec.outputs, results, strict=True):
            tensors[t.name] = keras.ops.convert_to_numpy(value)
    tensors.update(combine_outputs(manifest.combines, tensors))
    return {t.name: tensors[t.name] for t in manifest.signature.outputs}
