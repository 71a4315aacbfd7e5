"""What a cache key is made of: every byte of a model's files, the partitioner's own source;
and the digest memo, trusted only where a file cannot have changed unseen."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import shards
from shards.bundle import fingerprint
from shards.bundle.fingerprint import model_sha256, partitioner_modules, partitioner_sha256

PACKAGE = Path(shards.__file__).parent


def savedmodel(root: Path) -> Path:
    (root / "variables").mkdir(parents=True)
    (root / "assets").mkdir()
    (root / "saved_model.pb").write_bytes(b"graph")
    (root / "variables" / "variables.index").write_bytes(b"index")
    (root / "variables" / "variables.data-00000-of-00001").write_bytes(b"weights-1")
    (root / "assets" / "vocab.txt").write_bytes(b"a\nb\n")
    return root


@pytest.mark.parametrize(
    "change",
    [
        "variables/variables.data-00000-of-00001",
        "assets/vocab.txt",
        "saved_model.pb",
    ],
)
def test_every_file_of_a_savedmodel_is_in_its_digest(tmp_path: Path, change: str) -> None:
    model = savedmodel(tmp_path / "sm")
    before = model_sha256(model)
    data = (model / change).read_bytes()
    (model / change).write_bytes(data[:-1] + b"X")
    assert model_sha256(model) != before


def test_a_renamed_file_changes_the_digest(tmp_path: Path) -> None:
    model = savedmodel(tmp_path / "sm")
    before = model_sha256(model)
    (model / "assets" / "vocab.txt").rename(model / "assets" / "words.txt")
    assert model_sha256(model) != before


def test_the_memo_is_used_for_settled_files_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = savedmodel(tmp_path / "sm")
    memo_dir = tmp_path / "cache"
    real = model_sha256(model, memo_dir=memo_dir)
    memo_file = memo_dir / ".digests.json"
    memo = json.loads(memo_file.read_text())
    # Hashed just now: the files' timestamps are within the racy window, so the memo is not
    # trusted (a write in the same clock tick would look unchanged)...
    memo[str(model.resolve())]["sha256"] = "from-the-memo"
    memo_file.write_text(json.dumps(memo))
    assert model_sha256(model, memo_dir=memo_dir) == real
    # ...and once they are older than it, it is: the model is not read again.
    memo = json.loads(memo_file.read_text())
    memo[str(model.resolve())]["sha256"] = "from-the-memo"
    memo_file.write_text(json.dumps(memo))
    monkeypatch.setattr(fingerprint, "RACY_NS", -(10**12))
    assert model_sha256(model, memo_dir=memo_dir) == "from-the-memo"


def test_a_same_size_rewrite_with_its_old_mtime_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ctime moves on every write and cannot be set back, unlike mtime."""
    monkeypatch.setattr(fingerprint, "RACY_NS", -(10**12))
    model = savedmodel(tmp_path / "sm")
    weights = model / "variables" / "variables.data-00000-of-00001"
    memo_dir = tmp_path / "cache"
    before = model_sha256(model, memo_dir=memo_dir)
    st = weights.stat()
    weights.write_bytes(b"weights-2")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    assert model_sha256(model, memo_dir=memo_dir) != before
    assert model_sha256(model, memo_dir=memo_dir) == model_sha256(model)


def test_partitioner_modules_are_what_plans_and_cuts() -> None:
    modules = set(partitioner_modules())
    assert {
        "partition.cut",
        "partition.stages",
        "partition.oversized",
        "split.rule",
        "split.rewrite",
        "split.layers",
        "partition.graph",
        "partition.plan",
        "partition.memory_plan",
        "bundle.masking",
        "bundle.format",
        "partition.demo_models",
    } <= modules
    assert (
        not {
            "actor.stage_actor",
            "pipeline.replica_set",
            "cluster",
            "source.resolve",
            "bundle.cache",
        }
        & modules
    )


def test_partitioner_digest_follows_its_source_only(tmp_path: Path) -> None:
    copy = tmp_path / "shards"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = partitioner_sha256(copy)
    assert before == partitioner_sha256(PACKAGE)
    with (copy / "actor" / "stage_actor.py").open("a") as f:
        f.write("# not the partitioner\n")
    assert partitioner_sha256.__wrapped__(copy) == before
    with (copy / "partition" / "graph.py").open("a") as f:
        f.write("# a change to how models are cut\n")
    assert partitioner_sha256.__wrapped__(copy) != before
