"""ShardActor on the session Ray: only its stage's weights, exact outputs, no retrace, simulation,
and stage files shipped through the object store to a node that lacks them."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import ray

from shards.actor.stage_actor import ShardActor
from shards.bundle.format import BundleError, Manifest, read_manifest, write_manifest
from shards.bundle.shipping import ShippedStage, digest_stage_file, ship_stage, stage_dir_for
from shards.bundle.tensor_routes import plan_routes
from shards.partition.cut import partition_to_bundle
from tests.shards.model_zoo import Inputs, call_whole, sequential

WARM_SIZES = [1, 3, 8]


@pytest.fixture(scope="module")
def seq_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, keras.Model, Inputs]:
    model, inputs = sequential()
    out = tmp_path_factory.mktemp("seq_bundle")
    partition_to_bundle(model, out, stages=2)
    return out, model, inputs


@pytest.fixture(scope="module")
def manifest(seq_bundle: tuple[Path, keras.Model, Inputs]) -> Manifest:
    return read_manifest(seq_bundle[0])


@pytest.fixture(scope="module")
def actors(ray_address: str, seq_bundle: tuple[Path, keras.Model, Inputs]) -> Iterator[list[Any]]:
    remote: Any = ray.remote(ShardActor).options(num_cpus=1, max_concurrency=1)
    handles = [remote.remote(str(seq_bundle[0]), k, WARM_SIZES) for k in range(2)]
    yield handles
    for handle in handles:
        ray.kill(handle)


def _chain(actors: list[Any], manifest: Manifest, inputs: Inputs) -> dict[str, np.ndarray]:
    """The model outputs of a batch through ``actors``, one ref per tensor as the pipeline does."""
    routes, outputs = plan_routes(manifest)
    made: list[list[Any]] = []
    for actor, route in zip(actors, routes, strict=True):
        args = [inputs[s.name] if s.from_request else made[s.stage][s.index] for s in route.inputs]
        out = actor.forward.options(num_returns=route.num_returns).remote(*args)
        made.append([out] if route.num_returns == 1 else list(out))
    return {name: ray.get(made[s.stage][s.index]) for name, s in outputs.items()}


def test_each_actor_holds_only_its_stage_weights(
    actors: list[Any], manifest: Manifest, seq_bundle: tuple[Path, keras.Model, Inputs]
) -> None:
    whole_bytes = sum(w.nbytes for w in seq_bundle[1].get_weights())
    infos = ray.get([a.info.remote() for a in actors])

    for stage, info in zip(manifest.stages, infos, strict=True):
        assert info["stage_index"] == stage.index
        assert info["weight_bytes"] == stage.param_bytes == info["param_bytes"]
        assert 0 < info["weight_bytes"] < whole_bytes
    assert sum(i["weight_bytes"] for i in infos) == whole_bytes


def test_cpu_actor_uses_the_threads_of_its_cpus(actors: list[Any]) -> None:
    info = ray.get(actors[0].info.remote())

    assert info["device"] == "/CPU:0"
    assert info["intra_op_threads"] == 1
    assert info["gpu_ids"] == []


def test_chained_actors_match_the_whole_model(
    actors: list[Any], seq_bundle: tuple[Path, keras.Model, Inputs]
) -> None:
    _, model, inputs = seq_bundle
    expected = call_whole(model, inputs)

    out = _chain(actors, read_manifest(seq_bundle[0]), inputs)

    assert sorted(out) == sorted(expected)
    for name, want in expected.items():
        assert isinstance(out[name], np.ndarray)
        np.testing.assert_allclose(out[name], want, atol=1e-5, rtol=0)


def test_no_retrace_at_any_batch_size_after_warmup(actors: list[Any], manifest: Manifest) -> None:
    before = ray.get([a.info.remote() for a in actors])
    spec = manifest.signature.inputs[0]

    for rows in [*WARM_SIZES, 2, 5, 17]:
        batch = {spec.name: np.ones((rows, *(d or 1 for d in spec.shape)), spec.dtype)}
        out = _chain(actors, manifest, batch)
        assert all(v.shape[0] == rows for v in out.values())

    after = ray.get([a.info.remote() for a in actors])
    assert [i["trace_count"] for i in after] == [i["trace_count"] for i in before] == [1, 1]


def test_stats_report_compute_per_batch_row_count(actors: list[Any], manifest: Manifest) -> None:
    spec = manifest.signature.inputs[0]
    for rows in (17, 17, 5):
        _chain(actors, manifest, {spec.name: np.ones((rows, *(d or 1 for d in spec.shape)))})

    for stats in ray.get([a.stats.remote() for a in actors]):
        by_rows = stats["compute_by_rows"]
        assert by_rows[17]["count"] >= 2 and by_rows[5]["count"] >= 1
        assert 0 < by_rows[17]["ewma_ms"] < 60_000
        assert set(by_rows) <= set(range(1, 18))  # warm-up does not count: only batches
        # Every dimension known: length 0.
        assert stats["compute_by_shape"]["17,0"]["count"] == by_rows[17]["count"]
        assert stats["shapes_run"] == len(stats["compute_by_shape"]) >= 2


def test_forward_names_the_tensors_it_reads(actors: list[Any], manifest: Manifest) -> None:
    wanted = manifest.stages[1].inputs[0].name
    extra = np.zeros((1, 3), "float32")

    with pytest.raises(Exception, match=rf"reads 1 tensor\(s\) \['{wanted}'\]; got 2"):
        ray.get(actors[1].forward.remote(extra, extra))


def test_simulated_stage_returns_zeros_of_its_output_specs(
    ray_address: str, seq_bundle: tuple[Path, keras.Model, Inputs], manifest: Manifest
) -> None:
    stage = manifest.stages[0]
    remote: Any = ray.remote(ShardActor).options(num_cpus=2, max_concurrency=1)
    actor = remote.remote(str(seq_bundle[0]), 0, [4], simulate_device_ms=20.0)
    try:
        arrays = [seq_bundle[2][t.name] for t in stage.inputs]
        out = dict(
            zip(
                [t.name for t in stage.outputs],
                [ray.get(actor.forward.remote(*arrays))],
                strict=True,
            )
        )
        stats: dict[str, Any] = ray.get(actor.stats.remote())
        info: dict[str, Any] = ray.get(actor.info.remote())
    finally:
        ray.kill(actor)

    rows = next(iter(seq_bundle[2].values())).shape[0]
    for spec in stage.outputs:
        assert out[spec.name].shape == (rows, *spec.shape)
        assert out[spec.name].dtype == spec.np_dtype
        assert not out[spec.name].any()
    assert stats["calls"] == 1 and len(stats["intervals"]) == 1
    assert stats["last_compute_ms"] >= 20.0
    assert info["simulated"] and info["intra_op_threads"] == 2


def _shipped_actor(bundle_dir: Path, index: int, shipped: ShippedStage, cache: Path) -> Any:
    remote: Any = ray.remote(ShardActor).options(num_cpus=1, max_concurrency=1)
    return remote.remote(str(bundle_dir), index, [3], shipped=shipped, stage_cache_dir=str(cache))


def test_actor_on_a_node_with_its_file_reports_local(actors: list[Any]) -> None:
    infos = ray.get([a.info.remote() for a in actors])

    assert [i["loaded_from"] for i in infos] == ["local", "local"]


def test_actor_without_the_bundle_dir_loads_the_shipped_stage(
    actors: list[Any], seq_bundle: tuple[Path, keras.Model, Inputs], tmp_path: Path
) -> None:
    bundle, model, inputs = seq_bundle
    shipped = ship_stage(bundle, read_manifest(bundle), 1, put=True)
    actor = _shipped_actor(tmp_path / "not-on-this-node", 1, shipped, tmp_path / "cache")
    try:
        out = _chain([actors[0], actor], read_manifest(bundle), inputs)
        info = ray.get(actor.info.remote())
    finally:
        ray.kill(actor)

    assert info["loaded_from"] == "shipped"
    assert Path(info["stage_dir"]).parent == tmp_path / "cache"
    assert info["weight_bytes"] == read_manifest(bundle).stages[1].param_bytes
    for name, want in call_whole(model, inputs).items():
        np.testing.assert_allclose(out[name], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("damage", ["deleted", "overwritten"])
def test_stage_file_gone_after_the_driver_read_it_loads_shipped(
    actors: list[Any],
    seq_bundle: tuple[Path, keras.Model, Inputs],
    tmp_path: Path,
    damage: str,
) -> None:
    bundle, model, inputs = seq_bundle
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    shipped = ship_stage(copy, read_manifest(copy), 0, put=True)
    stage_file = copy / shipped.file
    if damage == "deleted":
        stage_file.unlink()
    else:
        stage_file.write_bytes(b"x" * shipped.digest.size)
    actor = _shipped_actor(copy, 0, shipped, tmp_path / "cache")
    try:
        out = _chain([actor, actors[1]], read_manifest(bundle), inputs)
        info = ray.get(actor.info.remote())
    finally:
        ray.kill(actor)

    assert info["loaded_from"] == "shipped"
    for name, want in call_whole(model, inputs).items():
        np.testing.assert_allclose(out[name], want, atol=1e-5, rtol=0)


def test_matching_local_file_is_used_even_when_bytes_were_shipped(
    seq_bundle: tuple[Path, keras.Model, Inputs], tmp_path: Path
) -> None:
    bundle = seq_bundle[0]
    shipped = ship_stage(bundle, read_manifest(bundle), 1, put=True)

    where, source = stage_dir_for(str(bundle), 1, shipped, tmp_path / "cache")

    assert (where, source) == (bundle, "local")
    assert not (tmp_path / "cache").exists()


def test_missing_file_without_shipped_bytes_names_the_file(
    seq_bundle: tuple[Path, keras.Model, Inputs], tmp_path: Path
) -> None:
    bundle = seq_bundle[0]
    shipped = ship_stage(bundle, read_manifest(bundle), 1, put=False)

    with pytest.raises(
        BundleError, match=rf"stage 1 file .*{shipped.file}.* no bytes were shipped"
    ):
        stage_dir_for(str(tmp_path / "elsewhere"), 1, shipped, tmp_path / "cache")


def test_a_stage_cache_others_can_write_to_is_refused(
    seq_bundle: tuple[Path, keras.Model, Inputs], tmp_path: Path
) -> None:
    """An entry found in the node's stage cache is loaded without hashing it again."""
    bundle = seq_bundle[0]
    shipped = ship_stage(bundle, read_manifest(bundle), 1, put=False)
    shared = tmp_path / "stages"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(BundleError, match=r"cache directory .*stages' is not private"):
        stage_dir_for(str(tmp_path / "elsewhere"), 1, shipped, shared)


def test_savedmodel_directory_travels_as_a_tar_and_is_cached(
    ray_address: str, seq_bundle: tuple[Path, keras.Model, Inputs], tmp_path: Path
) -> None:
    manifest = read_manifest(seq_bundle[0])
    stage = dataclasses.replace(manifest.stages[0], file="stage_0.savedmodel")
    manifest = dataclasses.replace(manifest, stages=(stage, *manifest.stages[1:]))
    source = tmp_path / "bundle" / stage.file
    (source / "variables").mkdir(parents=True)
    (source / "saved_model.pb").write_bytes(b"graph")
    (source / "variables" / "variables.index").write_bytes(b"index" * 100)
    shipped = ship_stage(tmp_path / "bundle", manifest, 0, put=True)

    where, source_kind = stage_dir_for(str(tmp_path / "absent"), 0, shipped, tmp_path / "cache")
    again = stage_dir_for(
        str(tmp_path / "absent"), 0, dataclasses.replace(shipped, payload=()), tmp_path / "cache"
    )

    assert source_kind == "shipped" and shipped.is_dir
    assert (where / stage.file / "variables" / "variables.index").read_bytes() == b"index" * 100
    assert digest_stage_file(where / stage.file) == shipped.digest
    assert read_manifest(where) == manifest
    assert again == (where, "shipped")


def test_directory_digest_depends_on_names_not_only_bytes(tmp_path: Path) -> None:
    for name, inner in [("a", "x.bin"), ("b", "y.bin")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / inner).write_bytes(b"same bytes")

    first, second = digest_stage_file(tmp_path / "a"), digest_stage_file(tmp_path / "b")

    assert first.size == second.size == len(b"same bytes")
    assert first.sha256 != second.sha256


def test_a_module_the_manifest_names_is_not_imported_without_the_operators_consent(
    ray_address: str, seq_bundle: tuple[Path, keras.Model, Inputs], tmp_path: Path
) -> None:
    """Importing a module runs its code, and the manifest is whoever wrote the bundle's word."""
    bundle = tmp_path / "b"
    shutil.copytree(seq_bundle[0], bundle)
    manifest = read_manifest(bundle)
    write_manifest(bundle, dataclasses.replace(manifest, imports=("colorsys",)))
    remote: Any = ray.remote(ShardActor).options(num_cpus=1, max_concurrency=1)
    refused = remote.remote(str(bundle), 0, [1])
    try:
        with pytest.raises(ray.exceptions.RayActorError) as failed:
            ray.get(refused.info.remote())
    finally:
        ray.kill(refused)
    assert "asks to import 'colorsys'" in str(failed.value)
    assert "pass --import colorsys if you trust it" in str(failed.value)
    allowed = remote.remote(str(bundle), 0, [1], imports=["colorsys"])
    try:
        assert ray.get(allowed.info.remote())["stage_index"] == 0
    finally:
        ray.kill(allowed)


def test_an_unknown_length_is_warmed_at_the_planned_sequence_length(
    ray_address: str, tmp_path: Path
) -> None:
    """Positions stop at 16 (a fixed position embedding): planned at 40, the warm-up fails
    there and says how to fix it; at length 1, as before, it would not have noticed. The
    partitioner now refuses 40 for this model (its bound is 16), so the plan of 40 is written
    into the manifest as a bundle from before the bound was read would have it."""
    import keras_hub

    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(20, 4, name="emb")(tokens)
    x = x + keras_hub.layers.PositionEmbedding(16, name="positions")(x)
    out = keras.layers.Dense(2, name="out")(keras.layers.GlobalAveragePooling1D(name="pool")(x))
    bundle = tmp_path / "b"
    manifest = partition_to_bundle(keras.Model(tokens, out), bundle, imports=["keras_hub"])
    (stage,) = manifest.stages
    assert stage.memory is not None and stage.memory.sequence_length == 16
    planned_at_40 = dataclasses.replace(stage.memory, sequence_length=40)
    stage = dataclasses.replace(stage, memory=planned_at_40)
    write_manifest(bundle, dataclasses.replace(manifest, stages=(stage,)))
    remote: Any = ray.remote(ShardActor).options(num_cpus=1, max_concurrency=1)
    actor = remote.remote(str(bundle), 0, [2], imports=["keras_hub"])
    try:
        with pytest.raises(ray.exceptions.RayActorError) as failed:
            ray.get(actor.info.remote())
    finally:
        ray.kill(actor)
    assert "stage 0 failed its warm-up batch of 2 row(s) at length 40" in str(failed.value)
    assert "--max-sequence-length at most its longest" in str(failed.value)
