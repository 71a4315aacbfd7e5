"""The bundle format: manifest round trip, clear errors, TensorFlow-free reads, lazy stage loads."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shards.bundle.fingerprint import built_with
from shards.bundle.format import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    BundleError,
    Manifest,
    StageSpec,
    allowed_imports,
    import_modules,
    load_stage,
    read_manifest,
    write_manifest,
)
from shards.signature import ModelSignature, TensorSpec


def make_manifest() -> Manifest:
    features = TensorSpec("features", (8,), "float32")
    mask = TensorSpec("mask", (None, 4), "float32")
    hidden = TensorSpec("dense_1", (16,), "float32")
    logits = TensorSpec("logits", (4,), "float32")
    return Manifest(
        format_version=FORMAT_VERSION,
        signature=ModelSignature("m", (features, mask), (logits,)),
        stages=(
            StageSpec(0, "stage_000.keras", (features,), (hidden,), 576, 256),
            StageSpec(1, "stage_001.keras", (hidden, mask), (logits,), 272, 128),
        ),
        source="m.keras",
        source_sha256="ab" * 32,
        imports=("my_layers",),
    )


def test_manifest_json_round_trip() -> None:
    manifest = make_manifest()
    data = json.loads(json.dumps(manifest.to_json()))
    assert Manifest.from_json(data) == manifest
    assert data["stages"][1]["inputs"][1] == {
        "name": "mask",
        "shape": [None, 4],
        "dtype": "float32",
    }


def test_write_then_read(tmp_path: Path) -> None:
    write_manifest(tmp_path, make_manifest())
    assert read_manifest(tmp_path) == make_manifest()
    assert read_manifest(str(tmp_path)).total_param_bytes == 576 + 272


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"'.*nope' does not exist"):
        read_manifest(tmp_path / "nope")


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=f"has no {MANIFEST_NAME}"):
        read_manifest(tmp_path)


def test_bad_json(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(BundleError, match=r"cannot read .* as JSON"):
        read_manifest(tmp_path)


def test_unknown_format_version(tmp_path: Path) -> None:
    data = make_manifest().to_json() | {"format_version": 99}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(BundleError, match="format_version is 99; this shardserve reads version 3"):
        read_manifest(tmp_path)


def test_a_version_1_bundle_is_refused_with_the_way_out(tmp_path: Path) -> None:
    """Cut by the code before masks, nested models and shared layers were cut anew: never
    served, even as a bundle the user gives."""
    data = make_manifest().to_json() | {"format_version": 1}
    del data["built_with"]
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(BundleError, match=r"older shardserve .*re-partition the source model"):
        read_manifest(tmp_path)


def test_the_manifest_records_the_code_that_cut_it(tmp_path: Path) -> None:
    write_manifest(tmp_path, make_manifest())
    recorded = json.loads((tmp_path / MANIFEST_NAME).read_text())["built_with"]
    assert recorded == built_with()
    assert set(recorded) == {"keras", "tensorflow", "partitioner_sha256"}
    assert recorded["keras"] == importlib.metadata.version("keras")


def test_missing_field(tmp_path: Path) -> None:
    data = make_manifest().to_json()
    del data["signature"]
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(BundleError, match=r"not a valid manifest.*signature"):
        read_manifest(tmp_path)


def test_reading_a_manifest_does_not_import_tensorflow(tmp_path: Path) -> None:
    write_manifest(tmp_path, make_manifest())
    code = (
        "import sys\n"
        "from shards.bundle.format import read_manifest\n"
        f"m = read_manifest({str(tmp_path)!r})\n"
        "print(len(m.stages), 'tensorflow' in sys.modules, 'keras' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    )
    assert out.stdout.split() == ["2", "False", "False"]


def test_missing_import_module_is_named() -> None:
    with pytest.raises(BundleError, match="cannot import module 'no_such_module_xyz'"):
        import_modules(["json", "no_such_module_xyz"])


def test_load_stage_index_out_of_range(tmp_path: Path) -> None:
    write_manifest(tmp_path, make_manifest())
    with pytest.raises(BundleError, match="stage index 2 is out of range; the bundle has 2"):
        load_stage(tmp_path, 2)


def test_load_stage_missing_file(tmp_path: Path) -> None:
    write_manifest(tmp_path, make_manifest())
    with pytest.raises(BundleError, match=r"stage 1 file .*stage_001.keras' is missing"):
        load_stage(tmp_path, 1)


def test_load_stage_reads_only_its_own_file(tmp_path: Path) -> None:
    from shards.partition.cut import partition_to_bundle
    from shards.partition.demo_models import build_demo

    manifest = partition_to_bundle(build_demo("demo-tiny"), tmp_path / "b", stages=3)
    for spec in manifest.stages[:2]:
        (tmp_path / "b" / spec.file).unlink()
    stage = load_stage(tmp_path / "b", 2)
    row = np.ones((2, *manifest.stages[2].inputs[0].shape), "float32")
    assert tuple(np.asarray(stage(row)).shape) == (2, 4)


@pytest.mark.parametrize(
    "name", ["../stage_000.keras", "/etc/stage.keras", "sub/stage.keras", "a\\b.keras", "", "..", 7]
)
def test_a_stage_file_that_is_not_one_plain_name_is_refused(tmp_path: Path, name: object) -> None:
    """A manifest is whoever wrote the bundle's word: ``../x`` or ``/x`` would load (and run) a
    file from anywhere on the node."""
    data = make_manifest().to_json()
    data["stages"][0]["file"] = name
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(BundleError, match=r"stage file .* is not a plain file name"):
        read_manifest(tmp_path)


def test_a_bundles_imports_need_the_operators_import_or_the_unsafe_flag() -> None:
    manifest = make_manifest()  # imports ("my_layers",)
    with pytest.raises(BundleError, match=r"import 'my_layers'.*pass --import my_layers if you"):
        allowed_imports(manifest, (), unsafe_deserialization=False)
    with pytest.raises(BundleError, match=r"'my_layers'"):
        allowed_imports(manifest, ("my_layers.sub", "other"), unsafe_deserialization=False)
    assert allowed_imports(manifest, ("other", "my_layers"), unsafe_deserialization=False) == (
        "my_layers",
        "other",
    )
    assert allowed_imports(manifest, (), unsafe_deserialization=True) == ("my_layers",)
