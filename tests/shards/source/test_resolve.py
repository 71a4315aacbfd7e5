"""resolve_bundle: every accepted kind of model argument, caching, and the errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shards.partition.cut
import shards.source.resolve
from shards.bundle import cache
from shards.bundle.fingerprint import built_with
from shards.bundle.format import BundleError, read_manifest
from shards.partition.cut import partition_to_bundle
from shards.partition.demo_models import DEMO_MODELS, build_demo
from shards.source.resolve import DEMO_NAMES, ResolveError, ResolveOptions, resolve_bundle
from tests.chain import run_chain
from tests.shards.model_zoo import small_bert


@pytest.fixture
def partition_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        return partition_to_bundle(*args, **kwargs)

    monkeypatch.setattr(shards.partition.cut, "partition_to_bundle", counting)
    return calls


def test_demo_names_match_the_demo_models() -> None:
    assert set(DEMO_NAMES) == set(DEMO_MODELS)


def test_demo_model_is_partitioned_once_then_reused(
    tmp_path: Path, partition_calls: list[Any]
) -> None:
    first = resolve_bundle(
        "demo-tiny", ResolveOptions(stages=2, max_stage_bytes=None, cache_dir=tmp_path)
    )
    second = resolve_bundle(
        "demo-tiny", ResolveOptions(stages=2, max_stage_bytes=None, cache_dir=tmp_path)
    )
    assert first == second
    assert len(partition_calls) == 1
    manifest = read_manifest(first)
    assert manifest.source == "demo:demo-tiny"
    assert len(manifest.stages) == 2
    # Only the finished bundle is left in the cache: the temporary directory was renamed.
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [first.name]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".partial-")]
    assert manifest.built_with == built_with()


def test_other_options_get_another_cache_entry(tmp_path: Path, partition_calls: list[Any]) -> None:
    two = resolve_bundle(
        "demo-tiny", ResolveOptions(stages=2, max_stage_bytes=None, cache_dir=tmp_path)
    )
    three = resolve_bundle(
        "demo-tiny", ResolveOptions(stages=3, max_stage_bytes=None, cache_dir=tmp_path)
    )
    assert two != three
    assert len(read_manifest(three).stages) == 3
    assert len(partition_calls) == 2


def test_another_max_sequence_length_gets_another_cache_entry(
    tmp_path: Path, partition_calls: list[Any]
) -> None:
    short = resolve_bundle(
        "demo-tiny",
        ResolveOptions(stages=1, max_stage_bytes=None, cache_dir=tmp_path, max_sequence_length=64),
    )
    again = resolve_bundle(
        "demo-tiny",
        ResolveOptions(stages=1, max_stage_bytes=None, cache_dir=tmp_path, max_sequence_length=64),
    )
    long = resolve_bundle(
        "demo-tiny", ResolveOptions(stages=1, max_stage_bytes=None, cache_dir=tmp_path)
    )
    assert short == again != long
    assert len(partition_calls) == 2
    plans = [read_manifest(b).stages[0].memory for b in (short, long)]
    assert [p.sequence_length if p else None for p in plans] == [64, 512]


def test_the_lookup_combine_is_passed_on_and_keys_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs["lookup_combine"])
        return partition_to_bundle(*args, **kwargs)

    monkeypatch.setattr(shards.partition.cut, "partition_to_bundle", recording)
    options = {"stages": 1, "max_stage_bytes": None, "cache_dir": tmp_path}
    routed = resolve_bundle("demo-tiny", ResolveOptions(**options))
    dense = resolve_bundle("demo-tiny", ResolveOptions(**options, lookup_combine="dense"))
    assert routed != dense and asked == ["routed", "dense"]
    with pytest.raises(ValueError, match="lookup_combine is 'routed' or 'dense', got 'sparse'"):
        ResolveOptions(**options, lookup_combine="sparse")


def test_a_model_with_its_own_bound_is_planned_at_it_and_a_longer_length_refused(
    tmp_path: Path,
) -> None:
    """A position embedding of 32 rows: with no length asked for, the cached bundle is planned
    at 32 (not 512) and says so in its signature; a bundle directory asked for 64 is refused
    naming both numbers, and 16 is taken."""
    model = tmp_path / "bert.keras"
    small_bert(32).save(model)
    cache_dir = tmp_path / "cache"
    bundle = resolve_bundle(
        str(model), ResolveOptions(stages=1, max_stage_bytes=None, cache_dir=cache_dir)
    )
    manifest = read_manifest(bundle)
    assert manifest.signature.max_length == 32
    assert [s.memory.sequence_length for s in manifest.stages if s.memory] == [32]
    with pytest.raises(ValueError, match="max_sequence_length=64 is over 32"):
        resolve_bundle(
            str(model),
            ResolveOptions(
                stages=1, max_stage_bytes=None, cache_dir=cache_dir, max_sequence_length=64
            ),
        )
    with pytest.raises(ResolveError, match=r"max_sequence_length=64 is over 32, the longest"):
        resolve_bundle(
            str(bundle),
            ResolveOptions(
                stages=None, max_stage_bytes=None, cache_dir=cache_dir, max_sequence_length=64
            ),
        )
    shorter = resolve_bundle(
        str(bundle),
        ResolveOptions(
            stages=None, max_stage_bytes=None, cache_dir=cache_dir, max_sequence_length=16
        ),
    )
    assert shorter == bundle


def _answers(bundle: Path) -> np.ndarray:
    signature = read_manifest(bundle).signature
    rows = {
        t.name: np.linspace(-1, 1, 2 * 8, dtype="float32").reshape(2, 8) for t in signature.inputs
    }
    (out,) = run_chain(bundle, rows).values()
    return out


def test_keras_file_is_cached_by_content(tmp_path: Path, partition_calls: list[Any]) -> None:
    path = tmp_path / "tiny.keras"
    model = build_demo("demo-tiny")
    model.save(path)
    cache_dir = tmp_path / "cache"
    first = resolve_bundle(
        str(path), ResolveOptions(stages=2, max_stage_bytes=None, cache_dir=cache_dir)
    )
    again = resolve_bundle(
        str(path), ResolveOptions(stages=2, max_stage_bytes=None, cache_dir=cache_dir)
    )
    assert first == again and first.parent == cache_dir
    assert len(partition_calls) == 1
    assert read_manifest(first).source == "tiny.keras"
    # New weights in the same file: a new bundle, and its answers are the new model's.
    model.set_weights([w * 2 + 0.1 for w in model.get_weights()])
    model.save(path)
    changed = resolve_bundle(
        str(path), ResolveOptions(stages=2, max_stage_bytes=None, cache_dir=cache_dir)
    )
    assert changed != first and len(partition_calls) == 2
    rows = np.linspace(-1, 1, 2 * 8, dtype="float32").reshape(2, 8)
    np.testing.assert_allclose(_answers(changed), model.predict(rows, verbose=0), rtol=1e-5)
    assert not np.allclose(_answers(changed), _answers(first))


def test_savedmodel_whose_variables_alone_change_gets_new_answers(tmp_path: Path) -> None:
    """Weights restored into the same graph: saved_model.pb stays byte-identical."""
    import tensorflow as tf

    saved = tmp_path / "sm"
    build_demo("demo-tiny").export(str(saved), verbose=False)
    cache_dir = tmp_path / "cache"
    first = resolve_bundle(
        str(saved), ResolveOptions(stages=None, max_stage_bytes=None, cache_dir=cache_dir)
    )
    assert read_manifest(first).stages[0].file.endswith(".savedmodel")
    graph = (saved / "saved_model.pb").read_bytes()
    loaded = tf.saved_model.load(str(saved))
    for variable in loaded.variables:
        variable.assign(variable * 2 + 0.1)
    tf.train.Checkpoint(loaded).write(str(saved / "variables" / "variables"))
    assert (saved / "saved_model.pb").read_bytes() == graph
    rows = tf.constant(np.linspace(-1, 1, 2 * 8, dtype="float32").reshape(2, 8))
    (want,) = loaded.signatures["serving_default"](rows).values()

    second = resolve_bundle(
        str(saved), ResolveOptions(stages=None, max_stage_bytes=None, cache_dir=cache_dir)
    )
    assert second != first
    np.testing.assert_allclose(_answers(second), want.numpy(), rtol=1e-5)
    assert not np.allclose(_answers(second), _answers(first))


@pytest.mark.parametrize("part", ["partitioner_sha256", "keras", "tensorflow"])
def test_a_bundle_cut_by_other_code_is_not_reused(
    tmp_path: Path, partition_calls: list[Any], monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    first = resolve_bundle(
        "demo-tiny", ResolveOptions(stages=2, max_stage_bytes=None, cache_dir=tmp_path)
    )
    other = {**built_with(), part: "other"}
    monkeypatch.setattr(shards.source.resolve, "built_with", lambda: other)
    second = resolve_bundle(
        "demo-tiny", ResolveOptions(stages=2, max_stage_bytes=None, cache_dir=tmp_path)
    )
    assert second != first
    assert len(partition_calls) == 2


def test_cache_is_pruned_to_its_bound_but_never_a_served_bundle(tmp_path: Path) -> None:
    one = resolve_bundle(
        "demo-tiny", ResolveOptions(stages=1, max_stage_bytes=None, cache_dir=tmp_path)
    )
    two = resolve_bundle(
        "demo-tiny", ResolveOptions(stages=2, max_stage_bytes=None, cache_dir=tmp_path)
    )
    os.utime(two, (1e9, 1e9))  # served, and the least recently used
    assert cache.hold(two)
    try:
        three = resolve_bundle(
            "demo-tiny",
            ResolveOptions(stages=3, max_stage_bytes=None, cache_dir=tmp_path, cache_max_bytes=1),
        )
    finally:
        cache.release(two)
    # Over the bound, the least recently used bundle not served goes; the new one stays.
    assert not one.exists()
    assert [e.path for e in cache.entries(tmp_path)] == [two, three]


def test_bundle_directory_is_used_as_is(tmp_path: Path, partition_calls: list[Any]) -> None:
    bundle = tmp_path / "b"
    partition_to_bundle(build_demo("demo-tiny"), bundle, stages=2)
    got = resolve_bundle(
        str(bundle), ResolveOptions(stages=2, max_stage_bytes=None, cache_dir=tmp_path / "c")
    )
    assert got == bundle
    assert partition_calls == []


def test_a_bundles_own_imports_need_the_operators_consent(tmp_path: Path) -> None:
    """A module a manifest names runs its code when imported: served only where the operator
    named it too (--import) or trusts the bundle whole (--unsafe-deserialization)."""
    bundle = tmp_path / "b"
    partition_to_bundle(build_demo("demo-tiny"), bundle, stages=1, imports=["colorsys"])
    args: dict[str, Any] = {"stages": None, "max_stage_bytes": None, "cache_dir": tmp_path / "c"}
    with pytest.raises(BundleError, match=r"asks to import 'colorsys'.*--import colorsys"):
        resolve_bundle(str(bundle), ResolveOptions(**args))
    assert resolve_bundle(str(bundle), ResolveOptions(imports=["colorsys"], **args)) == bundle
    assert (
        resolve_bundle(str(bundle), ResolveOptions(unsafe_deserialization=True, **args)) == bundle
    )


def test_a_cache_directory_others_can_write_to_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(BundleError, match=r"cache directory .*shared' is not private"):
        resolve_bundle(
            "demo-tiny", ResolveOptions(stages=1, max_stage_bytes=None, cache_dir=shared)
        )
    assert list(shared.iterdir()) == []  # refused before anything was read or written there


def test_bundle_with_other_stage_count_is_an_error(tmp_path: Path) -> None:
    partition_to_bundle(build_demo("demo-tiny"), tmp_path / "b", stages=2)
    with pytest.raises(ResolveError, match=r"has 2 stages but stages=3 was asked"):
        resolve_bundle(
            str(tmp_path / "b"), ResolveOptions(stages=3, max_stage_bytes=None, cache_dir=tmp_path)
        )


def test_bundle_over_the_budget_is_an_error(tmp_path: Path) -> None:
    partition_to_bundle(build_demo("demo-tiny"), tmp_path / "b", stages=1)
    with pytest.raises(
        ResolveError, match=r"stage 0 needs \d+ bytes at its peak \(1936 of weights\), over .*=1000"
    ):
        resolve_bundle(
            str(tmp_path / "b"),
            ResolveOptions(stages=None, max_stage_bytes=1000, cache_dir=tmp_path),
        )


def test_unknown_name_lists_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(ResolveError, match=r"'demo-nope' does not exist .*\.keras file.*demo-tiny"):
        resolve_bundle(
            "demo-nope", ResolveOptions(stages=None, max_stage_bytes=None, cache_dir=tmp_path)
        )


def test_unservable_file_lists_what_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"")
    with pytest.raises(ResolveError, match=r"cannot serve .*model.onnx'.*SavedModel directory"):
        resolve_bundle(
            str(tmp_path / "model.onnx"),
            ResolveOptions(stages=None, max_stage_bytes=None, cache_dir=tmp_path),
        )


def test_failed_partition_leaves_no_cache_entry(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="more than the model's 3 cuttable nodes"):
        resolve_bundle(
            "demo-tiny", ResolveOptions(stages=7, max_stage_bytes=None, cache_dir=tmp_path)
        )
    assert cache.entries(tmp_path) == []
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # nor a partial or its lock


def test_what_the_repository_reads_as_complete_is_what_keras_and_the_partitioner_write(
    tmp_path: Path,
) -> None:
    """serving.repository.layout checks names and a zip's directory only; here against a real
    .keras file (cut short while copied: not read), a one-stage bundle and its manifest."""
    from serving.repository.layout import MANIFEST_NAME, incomplete, model_kind, scan
    from shards.bundle.format import MANIFEST_NAME as BUNDLE_MANIFEST

    assert MANIFEST_NAME == BUNDLE_MANIFEST
    model = build_demo("demo-tiny")
    keras_dir = tmp_path / "repo" / "tiny" / "1"
    keras_dir.mkdir(parents=True)
    model.save(keras_dir / "tiny.keras")
    assert incomplete(keras_dir) is None and model_kind(keras_dir) == "keras"
    whole = (keras_dir / "tiny.keras").read_bytes()
    (keras_dir / "tiny.keras").write_bytes(whole[: len(whole) - 100])
    assert "tiny.keras is not a complete zip yet" in (incomplete(keras_dir) or "")
    bundle_dir = tmp_path / "repo" / "tiny" / "2"
    partition_to_bundle(model, bundle_dir, stages=1)
    assert incomplete(bundle_dir) is None and model_kind(bundle_dir) == "bundle"
    (bundle_dir / MANIFEST_NAME).unlink()  # a copy whose manifest has not arrived yet
    assert "without its manifest.json yet" in (incomplete(bundle_dir) or "")
    assert scan(tmp_path / "repo") == {"tiny": {}}
