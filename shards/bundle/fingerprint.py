"""What a cached bundle depends on, as digests: every byte of the model's files, the code that
planned and cut it, and the Keras and TensorFlow it was cut with.

A model's digest is memoised in the cache directory by each file's (size, mtime_ns, ctime_ns,
inode), so a multi-GB model is not read again on every start. Any write to a file moves its
ctime, which no tool can set back; a memo is trusted only for files whose timestamps were already
``RACY_NS`` old when it was hashed, so a write that lands in the same timestamp tick as the hash
(a coarse filesystem clock) is caught too, as git does for "racily clean" index entries.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

# The code that decides what a bundle holds: the partitioner and the demo models, with every
# shards module they import (found by reading their imports, so a new one cannot be left out).
_ROOTS = ("partition.cut", "partition.demo_models")
_HERE = Path(__file__).parent.parent  # the shards package
# The distribution names each library is installed under; the first one found is recorded.
_DISTRIBUTIONS = {
    "keras": ("keras", "keras-nightly"),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly"),
}
RACY_NS = 2_000_000_000  # the coarsest common timestamp tick (FAT) is 2 s
_MEMO_NAME = ".digests.json"
_MEMO_ENTRIES = 256
_CHUNK = 1 << 20


def library_versions() -> dict[str, str]:
    """The installed Keras and TensorFlow, read from package metadata (nothing is imported)."""
    found = {}
    for lib, names in _DISTRIBUTIONS.items():
        found[lib] = "not installed"
        for name in names:
            try:
                found[lib] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def partitioner_modules(package: Path = _HERE) -> list[str]:
    """The modules of ``package`` that the partitioner and the demo models import, themselves
    included, at any depth (imports inside functions too)."""
    seen: set[str] = set()
    todo = list(_ROOTS)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in ast.walk(ast.parse(_source(package, name).read_bytes())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                named = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                continue
            for module in named:
                top, _, rest = module.partition(".")
                if top == "shards" and rest and _source(package, rest).is_file():
                    todo.append(rest)
    return sorted(seen)


def _source(package: Path, module: str) -> Path:
    """The file of ``shards.<module>`` (dotted, relative to the package): a module or a package."""
    path = package.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


@functools.cache
def partitioner_sha256(package: Path = _HERE) -> str:
    """The sha256 of the partitioner's own source: a bundle cut by other code is another bundle,
    whatever the package's version string says."""
    digest = hashlib.sha256()
    for name in partitioner_modules(package):
        digest.update(f"{name}\0".encode())
        digest.update(_source(package, name).read_bytes())
    return digest.hexdigest()


def built_with() -> dict[str, str]:
    """What the manifest records of the code that cut a bundle."""
    return {**library_versions(), "partitioner_sha256": partitioner_sha256()}


def model_files(path: Path) -> list[Path]:
    """Every file of a model: the file itself, or every file under a SavedModel directory
    (``variables/`` and ``assets/`` included), sorted by relative path."""
    if path.is_file():
        return [path]
    # followlinks: shutil.copytree, which copies the model into the bundle, follows them too.
    files = [
        Path(root, name) for root, _, names in os.walk(path, followlinks=True) for name in names
    ]
    return sorted(files, key=lambda f: f.relative_to(path).as_posix())


def model_sha256(path: Path, memo_dir: Path | None = None) -> str:
    """sha256 over each file's relative path, size and content; memoised under ``memo_dir``."""
    path = path.resolve()
    files = model_files(path)
    stats = [_stat_key(path, f) for f in files]
    memo = _read_memo(memo_dir)
    entry = memo.get(str(path))
    if entry is not None and entry.get("stats") == stats and _settled(stats, entry["hashed_at"]):
        return str(entry["sha256"])
    hashed_at = time.time_ns()
    digest = hashlib.sha256()
    for file in files:
        rel = "" if file == path else file.relative_to(path).as_posix()
        digest.update(f"{rel}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                digest.update(chunk)
    sha = digest.hexdigest()
    if memo_dir is not None:
        memo.pop(str(path), None)
        memo[str(path)] = {"stats": stats, "hashed_at": hashed_at, "sha256": sha}
        _write_memo(memo_dir, memo)
    return sha


def _stat_key(root: Path, file: Path) -> list[Any]:
    st = file.stat()
    rel = "" if file == root else file.relative_to(root).as_posix()
    return [rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _settled(stats: list[list[Any]], hashed_at: int) -> bool:
    return all(max(s[2], s[3]) + RACY_NS < hashed_at for s in stats)


def _read_memo(memo_dir: Path | None) -> dict[str, Any]:
    if memo_dir is None:
        return {}
    try:
        data = json.loads((memo_dir / _MEMO_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_memo(memo_dir: Path, memo: dict[str, Any]) -> None:
    # Newest last (dicts keep insertion order): the oldest models fall out first.
    kept = dict(list(memo.items())[-_MEMO_ENTRIES:])
    tmp = None
    try:
        memo_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".digests-", dir=memo_dir)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(kept, f)
        # Concurrent resolvers: the last rename wins, and a lost entry costs one more hash.
        os.replace(tmp, memo_dir / _MEMO_NAME)
    except OSError:
        # A read-only cache still serves; the model is hashed again next time.
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
