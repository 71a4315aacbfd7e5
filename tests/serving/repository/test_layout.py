"""The repository on disk: which models and versions a scan finds, and a version read only once
it is complete (without reading a model's weights)."""

from __future__ import annotations

import logging
import os
import zipfile
from pathlib import Path

import pytest

from serving.repository.layout import VersionDir, fingerprint, incomplete, model_kind, scan
from shards.bundle.format import MANIFEST_NAME


def keras_file(path: Path, members: tuple[str, ...] = ("config.json", "model.weights.h5")) -> Path:
    """A stand-in .keras file: a zip holding what Keras 3 writes (tests/shards checks a real one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for name in members:
            archive.writestr(name, b"{}" if name.endswith(".json") else b"\0" * 64)
    return path


def savedmodel(path: Path, variables: bool = True) -> Path:
    (path / "variables").mkdir(parents=True)
    (path / "saved_model.pb").write_bytes(b"pb")
    if variables:
        (path / "variables" / "variables.index").write_bytes(b"index")
        (path / "variables" / "variables.data-00000-of-00001").write_bytes(b"data")
    return path


def preset(path: Path, weights: bool = True, libver: str = "earliest") -> Path:
    """A stand-in keras_hub preset: its JSON files and a real HDF5 weights file."""
    import h5py
    import numpy as np

    path.mkdir(parents=True)
    for name in ("metadata.json", "config.json", "task.json"):
        (path / name).write_text("{}")
    if weights:
        with h5py.File(path / "model.weights.h5", "w", libver=libver) as f:
            f["w"] = np.zeros(4096, np.float32)
    return path


def bundle(path: Path, manifest: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "stage_000.keras").write_bytes(b"stage")
    if manifest:
        (path / MANIFEST_NAME).write_text("{}")
    return path


def test_models_and_versions_of_every_kind(tmp_path: Path) -> None:
    keras_file(tmp_path / "mlp" / "1" / "mlp.keras")
    keras_file(tmp_path / "mlp" / "3" / "mlp.keras")
    savedmodel(tmp_path / "tf_model" / "7")
    bundle(tmp_path / "cut.v2" / "2")
    found = scan(tmp_path)
    assert {name: sorted(versions) for name, versions in found.items()} == {
        "mlp": [1, 3],
        "tf_model": [7],
        "cut.v2": [2],
    }
    v3 = found["mlp"][3]
    assert (v3.name, v3.version, v3.kind, v3.path) == ("mlp", 3, "keras", tmp_path / "mlp" / "3")
    assert v3.model_path == tmp_path / "mlp" / "3" / "mlp.keras"
    assert found["tf_model"][7].kind == "savedmodel"
    assert found["tf_model"][7].model_path == tmp_path / "tf_model" / "7"
    assert found["cut.v2"][2].kind == "bundle"
    assert found["cut.v2"][2].model_path == tmp_path / "cut.v2" / "2"


def test_hidden_odd_and_non_directory_entries_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keras_file(tmp_path / "m" / "1" / "m.keras")
    keras_file(tmp_path / "m" / ".2" / "m.keras")  # a version being copied in
    keras_file(tmp_path / ".staging" / "1" / "m.keras")  # a model being copied in
    for odd in ("0", "01", "v3", "-1", "latest", "1.5"):
        keras_file(tmp_path / "m" / odd / "m.keras")
    keras_file(tmp_path / "bad name!" / "1" / "m.keras")
    (tmp_path / "m" / "5").write_text("a file, not a directory")
    (tmp_path / "README.txt").write_text("a file at the top")
    (tmp_path / "m" / "config.toml").write_text("")
    with caplog.at_level(logging.DEBUG, "shardserve.repository"):
        found = scan(tmp_path)
    assert {name: sorted(versions) for name, versions in found.items()} == {"m": [1]}
    logged = caplog.text
    assert "m/v3 is not a positive version number" in logged
    assert "'bad name!' is not a model name" in logged
    assert ".staging" not in logged and ".2" not in logged  # hidden: silent


def test_a_model_without_complete_versions_is_listed_empty(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    keras_file(tmp_path / "half" / "1" / "half.keras", members=("model.weights.h5",))
    assert scan(tmp_path) == {"empty": {}, "half": {}}


def test_scan_of_a_missing_root_names_it(tmp_path: Path) -> None:
    with pytest.raises(NotADirectoryError, match="gone"):
        scan(tmp_path / "gone")


def test_a_keras_file_cut_short_is_incomplete_until_whole(tmp_path: Path) -> None:
    whole = keras_file(tmp_path / "src" / "m.keras")
    data = whole.read_bytes()
    target = tmp_path / "repo" / "m" / "1" / "m.keras"
    target.parent.mkdir(parents=True)
    # Any prefix of the copy lacks the central directory, which a zip writes last.
    for cut in (0, 10, len(data) // 2, len(data) - 1):
        target.write_bytes(data[:cut])
        reason = incomplete(target.parent)
        assert reason is not None and reason.startswith("m.keras is not a complete zip yet"), cut
        assert scan(tmp_path / "repo") == {"m": {}}
    target.write_bytes(data)
    assert incomplete(target.parent) is None
    assert sorted(scan(tmp_path / "repo")["m"]) == [1]


def test_completeness_reads_only_the_zip_directory(tmp_path: Path) -> None:
    """A member that is not a zip of its own (a weights file) is never opened: its bytes may be
    anything. A file the size of a large model stays cheap to check."""
    path = keras_file(tmp_path / "1" / "m.keras")
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("assets/big.bin", os.urandom(1 << 20))
    assert incomplete(tmp_path / "1") is None


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda p: keras_file(p / "m.keras", members=("weights.h5",)), "holds no config.json"),
        (lambda p: (keras_file(p / "a.keras"), keras_file(p / "b.keras")), "2 .keras files"),
        (lambda p: savedmodel(p, variables=False), "without variables/variables.index"),
        (lambda p: bundle(p, manifest=False), "a bundle without its manifest.json yet"),
        # A one-stage bundle's stage file is a whole .keras zip: still a bundle being copied.
        (lambda p: keras_file(p / "stage_000.keras"), "a bundle without its manifest.json yet"),
        (lambda p: p.mkdir(parents=True), "no .keras file, SavedModel"),
        (lambda p: preset(p, weights=False), "a keras_hub preset without its model.weights.h5"),
    ],
)
def test_incomplete_says_why(tmp_path: Path, make: object, reason: str) -> None:
    version = tmp_path / "m" / "1"
    make(version)  # type: ignore[operator]
    found = incomplete(version)
    assert found is not None and reason in found
    assert str(tmp_path) not in found  # the index shows reasons to clients: no server paths
    assert scan(tmp_path) == {"m": {}}


def test_the_kind_follows_the_names_a_version_holds(tmp_path: Path) -> None:
    assert model_kind(bundle(tmp_path / "b")) == "bundle"  # its stage .keras files do not count
    assert model_kind(savedmodel(tmp_path / "s", variables=False)) == "savedmodel"
    assert model_kind(keras_file(tmp_path / "k" / "m.keras").parent) == "keras"
    assert model_kind(preset(tmp_path / "p")) == "preset"
    assert model_kind(tmp_path) is None


@pytest.mark.parametrize("libver", ["earliest", "latest"])  # HDF5 superblocks 0 and 3
def test_a_preset_is_complete_once_its_weights_file_is_whole(tmp_path: Path, libver: str) -> None:
    version = preset(tmp_path / "lm" / "1", libver=libver)
    assert incomplete(version) is None
    assert scan(tmp_path)["lm"][1].model_path == version  # served from its directory
    weights = version / "model.weights.h5"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])  # a copy under way
    found = incomplete(version)
    assert found is not None and "model.weights.h5 is not a complete HDF5 file yet" in found
    assert scan(tmp_path) == {"lm": {}}
    weights.write_bytes(whole)
    (version / "task.json").unlink()
    assert incomplete(version) == "a keras_hub preset without its task.json yet"


def test_the_fingerprint_changes_with_a_files_size_or_mtime_only(tmp_path: Path) -> None:
    version = savedmodel(tmp_path / "1")
    first = fingerprint(version)
    assert fingerprint(version) == first
    data = version / "variables" / "variables.data-00000-of-00001"
    data.write_bytes(b"DATA")  # same size, new mtime
    stat = data.stat()
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = fingerprint(version)
    assert second != first
    data.write_bytes(b"longer data")
    assert fingerprint(version) not in (first, second)
    assert isinstance(scan(tmp_path.parent)[tmp_path.name][1], VersionDir)


def test_a_keras_file_gone_since_the_scan_is_named(tmp_path: Path) -> None:
    keras_file(tmp_path / "m" / "1" / "m.keras")
    found = scan(tmp_path)
    (tmp_path / "m" / "1" / "m.keras").unlink()
    with pytest.raises(FileNotFoundError, match=r"m/1 no longer holds one \.keras file"):
        _ = found["m"][1].model_path
