"""The repository on disk: ``<root>/<name>/<version>/`` holding a ``.keras`` file, a SavedModel,
a partitioned bundle or a keras_hub preset (a causal LM that generates), and which of those
version directories are complete.

A version is read only once it is complete, so a half-copied one is never loaded: a ``.keras``
file whose zip central directory (written last) opens and names ``config.json``; a SavedModel
with ``saved_model.pb`` and ``variables/variables.index``; a bundle with its ``manifest.json``
(the partitioner writes it last, atomically); a keras_hub preset (``save_to_preset``) with its
``metadata.json``, ``config.json``, ``task.json`` and a ``model.weights.h5`` whose HDF5
superblock's end-of-file address is within the file (a copy cut short is not). Every check reads
directory entries and at most a zip's central directory or an HDF5 superblock, never a model's
weights. Anything else (hidden entries, names that are not a model name or a positive integer,
files) is ignored with a debug log line; users copy a new version into a hidden directory and
rename it, so it appears whole. A version directory that holds a model's files but is not
complete is reported (``scan_all``): the server lists one that stops changing as unavailable,
with why (``serving.repository.source``).

Reasons and log lines name entries relative to the repository (``resnet/3``), never the
server's own paths: the index shows them to clients.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from serving.settings.repository import MODEL_NAME_PATTERN

__all__ = [
    "MANIFEST_NAME",
    "MODEL_NAME_PATTERN",
    "Incomplete",
    "ModelKind",
    "VersionDir",
    "incomplete",
    "is_model_name",
    "model_kind",
    "parse_version",
    "scan",
    "scan_all",
]

log = logging.getLogger("shardserve.repository")

ModelKind = Literal["keras", "savedmodel", "bundle", "preset"]
# shards.bundle.format.MANIFEST_NAME; not imported, this package stays free of `shards`
# (a test checks that they agree).
MANIFEST_NAME = "manifest.json"
_MODEL_NAME = re.compile(MODEL_NAME_PATTERN)
_VERSION = re.compile(r"[1-9][0-9]{0,17}")  # a positive int64, without leading zeros
# The stage files of a bundle (shards.partition: stage_000.keras, stage_000.savedmodel).
_BUNDLE_STAGE = re.compile(r"stage_[0-9]+\.(keras|savedmodel)")
# A keras_hub preset's JSON files (shards.generation.preset reads them) and its weights.
_PRESET_FILES = ("metadata.json", "config.json", "task.json")
_PRESET_WEIGHTS = "model.weights.h5"
_PRESET_SHARDED_WEIGHTS = "model.weights.json"  # a preset saved in shards: its index
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


@dataclass(frozen=True)
class VersionDir:
    name: str
    version: int
    path: Path
    kind: ModelKind
    fingerprint: str

    @property
    def model_path(self) -> Path:
        """What the server loads: the one ``.keras`` file, or the directory itself."""
        if self.kind != "keras":
            return self.path
        files = _keras_files(self.path)
        if len(files) != 1:
            # Changed on disk since the scan; the next scan sees it as it is now.
            raise FileNotFoundError(
                f"{self.name}/{self.version} no longer holds one .keras file ({len(files)} now)"
            )
        return files[0]


@dataclass(frozen=True)
class Incomplete:
    """A version directory that holds a model's files (a ``.keras``, a ``saved_model.pb``, a
    stage file) but cannot be read: a copy under way, or one that will never complete."""

    version: int
    reason: str  # ``incomplete``'s
    fingerprint: str  # its files now: unchanged over a while, the copy is not under way


def is_model_name(name: str) -> bool:
    return not name.startswith(".") and _MODEL_NAME.fullmatch(name) is not None


def parse_version(name: str) -> int | None:
    """The version a directory name stands for (``"3"`` -> 3), or None (``"03"``, ``"v3"``)."""
    return int(name) if _VERSION.fullmatch(name) else None


def scan(root: Path) -> dict[str, dict[int, VersionDir]]:
    """Every model directory under ``root`` and its complete versions. A model directory with
    no complete version is there with an empty dict (it exists; nothing of it can be served).
    Raises ``NotADirectoryError`` when ``root`` is not a directory."""
    return scan_all(root)[0]


def scan_all(
    root: Path,
) -> tuple[dict[str, dict[int, VersionDir]], dict[str, dict[int, Incomplete]]]:
    """``scan``'s complete versions, and per model the version directories that hold a model's
    files but are not complete (an empty one is left out: nothing was put there yet)."""
    if not root.is_dir():
        raise NotADirectoryError(f"the model repository {str(root)!r} is not a directory")
    models: dict[str, dict[int, VersionDir]] = {}
    partial: dict[str, dict[int, Incomplete]] = {}
    for entry in _entries(root):
        if not entry.is_dir():
            continue
        if not is_model_name(entry.name):
            log.debug("model repository: %r is not a model name, ignored", entry.name)
            continue
        models[entry.name] = _versions(entry, partial.setdefault(entry.name, {}))
        if not partial[entry.name]:
            del partial[entry.name]
    return models, partial


def _versions(model_dir: Path, partial: dict[int, Incomplete]) -> dict[int, VersionDir]:
    found: dict[int, VersionDir] = {}
    for entry in _entries(model_dir):
        version = parse_version(entry.name)
        where = f"{model_dir.name}/{entry.name}"
        if version is None or not entry.is_dir():
            if entry.is_dir():
                log.debug("model repository: %s is not a positive version number, ignored", where)
            continue
        reason = incomplete(entry)
        if reason is not None:
            log.debug("model repository: %s skipped until complete: %s", where, reason)
            if model_kind(entry) is not None:
                partial[version] = Incomplete(version, reason, fingerprint(entry))
            continue
        kind = model_kind(entry)
        assert kind is not None  # complete implies a kind
        found[version] = VersionDir(model_dir.name, version, entry, kind, fingerprint(entry))
    return found


def model_kind(version_dir: Path) -> ModelKind | None:
    """What the directory holds by its names alone (complete or not); None: nothing known."""
    if (version_dir / MANIFEST_NAME).exists() or any(
        _BUNDLE_STAGE.fullmatch(p.name) for p in _entries(version_dir)
    ):
        # A bundle's stage files come before its manifest: without it, a one-stage bundle's
        # stage_000.keras must not pass for a whole .keras model.
        return "bundle"
    if (version_dir / "saved_model.pb").exists():
        return "savedmodel"
    if (version_dir / "metadata.json").exists():
        return "preset"
    if _keras_files(version_dir):
        return "keras"
    return None


def incomplete(path: Path) -> str | None:
    """Why the version directory at ``path`` cannot be read yet (one line), or None when it is
    complete."""
    try:
        kind = model_kind(path)
        if kind is None:
            return (
                "no .keras file, SavedModel (saved_model.pb), bundle (manifest.json) or keras_hub "
                "preset (metadata.json) in it yet"
            )
        if kind == "bundle":
            if (path / MANIFEST_NAME).is_file():
                return None
            return f"a bundle without its {MANIFEST_NAME} yet (the partitioner writes it last)"
        if kind == "savedmodel":
            if not (path / "saved_model.pb").is_file():
                return "saved_model.pb is not a file"
            if not (path / "variables" / "variables.index").is_file():
                return "a SavedModel without variables/variables.index yet"
            return None
        if kind == "preset":
            return _preset_incomplete(path)
        return _keras_incomplete(_keras_files(path))
    except OSError as exc:
        return f"cannot be read: {exc.strerror or type(exc).__name__}"


def _preset_incomplete(path: Path) -> str | None:
    missing = [name for name in _PRESET_FILES if not (path / name).is_file()]
    if missing:
        return f"a keras_hub preset without its {', '.join(missing)} yet"
    if (path / _PRESET_SHARDED_WEIGHTS).is_file():
        return None
    weights = path / _PRESET_WEIGHTS
    if not weights.is_file():
        return f"a keras_hub preset without its {_PRESET_WEIGHTS} yet"
    return _hdf5_incomplete(weights)


def _hdf5_incomplete(file: Path) -> str | None:
    """Why an HDF5 file is not whole yet: its superblock (the first bytes) holds the file's
    end-of-file address, which a copy cut short has not reached."""
    with file.open("rb") as handle:
        head = handle.read(64)
        size = os.fstat(handle.fileno()).st_size
    if len(head) < 48 or not head.startswith(_HDF5_SIGNATURE):
        return f"{file.name} is not a complete HDF5 file yet"
    version = head[8]
    # Superblock 0/1: the addresses follow 16 (v1: 20) bytes of versions and sizes: base,
    # free space, end of file; 2/3: base, extension, end of file after 4 bytes.
    offset = {0: 40, 1: 44, 2: 28, 3: 28}.get(version)
    if offset is None:
        return f"{file.name} has an HDF5 superblock version {version} this server does not read"
    base_at = {0: 24, 1: 28}.get(version, 12)
    base = int.from_bytes(head[base_at : base_at + 8], "little")
    end = int.from_bytes(head[offset : offset + 8], "little")
    if size < base + end:
        return f"{file.name} is not a complete HDF5 file yet ({size} of {base + end} bytes)"
    return None


def _keras_incomplete(files: list[Path]) -> str | None:
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        return f"holds {len(files)} .keras files ({names}); keep one per version"
    file = files[0]
    try:
        # ZipFile reads only the end record and the central directory, both written last: a
        # file still being copied has neither. No member is read.
        with zipfile.ZipFile(file) as archive:
            members = set(archive.namelist())
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:
        return f"{file.name} is not a complete zip yet ({exc})"
    if "config.json" not in members:
        return f"{file.name} holds no config.json; not a Keras 3 .keras file"
    return None


def fingerprint(path: Path) -> str:
    """A digest of every file's relative name, size and mtime under ``path`` (stat only): it
    changes when the version's files do, so a failed version is retried only then."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for filename in sorted(filenames):
            file = Path(dirpath, filename)
            try:
                stat = file.stat()
            except OSError:
                continue  # removed while walking: the next scan sees the new state
            rel = file.relative_to(path).as_posix()
            digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _keras_files(version_dir: Path) -> list[Path]:
    return [
        p
        for p in _entries(version_dir)
        if p.suffix == ".keras" and not p.name.startswith(".") and p.is_file()
    ]


def _entries(directory: Path) -> list[Path]:
    """The directory's entries, sorted, hidden ones left out."""
    try:
        return sorted(p for p in directory.iterdir() if not p.name.startswith("."))
    except OSError as exc:
        log.debug("model repository: cannot list %s: %s", directory.name, exc.strerror)
        return []
