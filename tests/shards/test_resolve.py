"""resolve_bundle: every accepted kind of model argument, caching, and the errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import shards.partition
from shards.bundle import read_manifest
from shards.models import DEMO_MODELS, build_demo
from shards.partition import partition_to_bundle
from shards.resolve import DEMO_NAMES, ResolveError, resolve_bundle


@pytest.fixture
def partition_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        return partition_to_bundle(*args, **kwargs)

    monkeypatch.setattr(shards.partition, "partition_to_bundle", counting)
    return calls


def test_demo_names_match_the_demo_models() -> None:
    assert set(DEMO_NAMES) == set(DEMO_MODELS)


def test_demo_model_is_partitioned_once_then_reused(
    tmp_path: Path, partition_calls: list[Any]
) -> None:
    first = resolve_bundle("demo-tiny", stages=2, max_stage_bytes=None, cache_dir=tmp_path)
    second = resolve_bundle("demo-tiny", stages=2, max_stage_bytes=None, cache_dir=tmp_path)
    assert first == second
    assert len(partition_calls) == 1
    manifest = read_manifest(first)
    assert manifest.source == "demo:demo-tiny"
    assert len(manifest.stages) == 2
    # Only the finished bundle is left in the cache: the temporary directory was renamed.
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_other_options_get_another_cache_entry(tmp_path: Path, partition_calls: list[Any]) -> None:
    two = resolve_bundle("demo-tiny", stages=2, max_stage_bytes=None, cache_dir=tmp_path)
    three = resolve_bundle("demo-tiny", stages=3, max_stage_bytes=None, cache_dir=tmp_path)
    assert two != three
    assert len(read_manifest(three).stages) == 3
    assert len(partition_calls) == 2


def test_keras_file_is_cached_by_content(tmp_path: Path, partition_calls: list[Any]) -> None:
    path = tmp_path / "tiny.keras"
    build_demo("demo-tiny").save(path)
    cache = tmp_path / "cache"
    first = resolve_bundle(str(path), stages=None, max_stage_bytes=None, cache_dir=cache)
    again = resolve_bundle(str(path), stages=None, max_stage_bytes=None, cache_dir=cache)
    assert first == again and first.parent == cache
    assert len(partition_calls) == 1
    assert read_manifest(first).source == "tiny.keras"


def test_bundle_directory_is_used_as_is(tmp_path: Path, partition_calls: list[Any]) -> None:
    bundle = tmp_path / "b"
    partition_to_bundle(build_demo("demo-tiny"), bundle, stages=2)
    got = resolve_bundle(str(bundle), stages=2, max_stage_bytes=None, cache_dir=tmp_path / "c")
    assert got == bundle
    assert partition_calls == []


def test_bundle_with_other_stage_count_is_an_error(tmp_path: Path) -> None:
    partition_to_bundle(build_demo("demo-tiny"), tmp_path / "b", stages=2)
    with pytest.raises(ResolveError, match=r"has 2 stages but stages=3 was asked"):
        resolve_bundle(str(tmp_path / "b"), stages=3, max_stage_bytes=None, cache_dir=tmp_path)


def test_bundle_over_the_budget_is_an_error(tmp_path: Path) -> None:
    partition_to_bundle(build_demo("demo-tiny"), tmp_path / "b", stages=1)
    with pytest.raises(
        ResolveError, match=r"stage 0 needs \d+ bytes at its peak \(1936 of weights\), over .*=1000"
    ):
        resolve_bundle(str(tmp_path / "b"), stages=None, max_stage_bytes=1000, cache_dir=tmp_path)


def test_savedmodel_directory(tmp_path: Path) -> None:
    build_demo("demo-tiny").export(str(tmp_path / "sm"), verbose=False)
    got = resolve_bundle(
        str(tmp_path / "sm"), stages=None, max_stage_bytes=None, cache_dir=tmp_path / "c"
    )
    assert read_manifest(got).stages[0].file.endswith(".savedmodel")


def test_unknown_name_lists_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(ResolveError, match=r"'demo-nope' does not exist .*\.keras file.*demo-tiny"):
        resolve_bundle("demo-nope", stages=None, max_stage_bytes=None, cache_dir=tmp_path)


def test_unservable_file_lists_what_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"")
    with pytest.raises(ResolveError, match=r"cannot serve .*model.onnx'.*SavedModel directory"):
        resolve_bundle(
            str(tmp_path / "model.onnx"), stages=None, max_stage_bytes=None, cache_dir=tmp_path
        )


def test_failed_partition_leaves_no_cache_entry(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="more than the model's 3 cuttable nodes"):
        resolve_bundle("demo-tiny", stages=7, max_stage_bytes=None, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
