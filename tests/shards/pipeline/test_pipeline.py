"""ReplicaSet on the session Ray (4 logical CPUs, 0 GPUs): exact outputs through chained
stages, stages overlapping in time, surviving a killed shard, replicas, clear placement errors,
stage files shipped to actors that lack them, a close that cannot hang."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import pytest_asyncio
import ray

import shards.pipeline.placement
import shards.pipeline.replica
import shards.pipeline.watchdog
from serving.batching.batcher import Batcher, BatchSettings
from shards.bundle.format import Manifest, read_manifest
from shards.bundle.shipping import ShippedStage, ship_bundle, stages_off_node
from shards.partition.cut import partition_to_bundle
from shards.pipeline.replica_set import (
    InsufficientResourcesError,
    PipelineOptions,
    PipelineStartError,
    Replica,
    ReplicaSet,
)
from tests.shards.model_zoo import Inputs, call_whole, encoder, sequential

Case = tuple[Path, keras.Model, Inputs]


def _partitioned(tmp: Path, build: object) -> Case:
    model, inputs = build()  # type: ignore[operator]
    partition_to_bundle(model, tmp, stages=2)
    return tmp, model, inputs


@pytest.fixture(scope="module")
def seq_case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return _partitioned(tmp_path_factory.mktemp("seq"), sequential)


@pytest.fixture(scope="module")
def encoder_case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return _partitioned(tmp_path_factory.mktemp("encoder"), encoder)


def _assert_matches(out: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert list(out) == list(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(out[name], want, atol=1e-5, rtol=0)


async def test_two_stages_match_the_whole_model(ray_address: str, seq_case: Case) -> None:
    bundle, model, inputs = seq_case
    group = await ReplicaSet.create(bundle, PipelineOptions(batch_sizes=(3,)))
    try:
        out = await group.run(inputs)
        infos = await group.describe()
    finally:
        await group.close()

    _assert_matches(out, call_whole(model, inputs))
    assert group.num_stages == 2 and group.replicas == 1
    assert [i["stage_index"] for i in infos] == [0, 1]
    # One node holds the driver and both stages: nothing is shipped by default.
    assert [i["loaded_from"] for i in infos] == ["local", "local"]


async def test_model_input_routed_past_stage_0_to_stage_1(
    ray_address: str, encoder_case: Case
) -> None:
    bundle, model, inputs = encoder_case
    stages = read_manifest(bundle).stages
    # The mask is a model input that the last stage reads directly, not through stage 0.
    assert "mask" in [t.name for t in stages[1].inputs]
    assert "mask" not in [t.name for t in stages[0].outputs]
    group = await ReplicaSet.create(bundle, PipelineOptions(batch_sizes=(3,)))
    try:
        out = await group.run(inputs)
    finally:
        await group.close()

    _assert_matches(out, call_whole(model, inputs))


def test_ray_says_when_a_return_exists_without_fetching_it(ray_address: str) -> None:
    # The hook the watchdog's clock starts a batch by (shards.pipeline.watchdog): without it the clock
    # falls back to starting when the batch ahead is done, and nothing else would fail.
    assert shards.pipeline.watchdog.ON_READY, (
        "ray.ObjectRef._on_ready is gone from this Ray; pin ray in pyproject.toml or port "
        "shards/pipeline/watchdog.py's set_when_ready to the new API"
    )
    ready = threading.Event()
    ref = ray.put(np.zeros(4))
    ref._on_ready(lambda exc: ready.set() if exc is None else None)
    assert ready.wait(10)


def _overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


async def test_stages_work_on_different_batches_at_the_same_time(
    ray_address: str, seq_case: Case
) -> None:
    bundle, _, inputs = seq_case
    # Each batch takes ~0.2 s from when stage 0 starts it; the last of 8 sent at once is
    # answered ~0.9 s after it was sent. The watchdog times the former, so none is abandoned.
    options = PipelineOptions(
        batch_sizes=(3,), simulate_device_ms=100.0, batch_hard_timeout_s=0.6, max_restarts=0
    )
    group = await ReplicaSet.create(bundle, options)
    try:
        await asyncio.gather(*(group.run(inputs) for _ in range(8)))
        stats = {s["stage_index"]: s["intervals"] for s in await group.stats()}
    finally:
        await group.close()

    assert len(stats[0]) == len(stats[1]) == 8
    assert stats[1][-1][1] - stats[0][0][0] > 0.6  # the last batch queued past the limit
    # A sync actor runs its calls in submission order, so interval n is batch n on both stages.
    for n in range(7):
        assert _overlaps(stats[0][n + 1], stats[1][n]), (n, stats)


async def _until(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def two_replicas(ray_address: str, seq_case: Case) -> AsyncIterator[ReplicaSet]:
    # Both sizes the class's tests send; the warm-up runs each once per replica.
    group = await ReplicaSet.create(seq_case[0], PipelineOptions(replicas=2, batch_sizes=(1, 3)))
    try:
        yield group
    finally:
        await group.close()


@pytest.mark.asyncio(loop_scope="class")
class TestTwoReplicas:
    """One set of two replicas (the session Ray's 4 CPUs), started once: each test leaves it
    with both replicas healthy, and the set is closed when the class ends."""

    async def test_killed_shard_costs_latency_not_requests(
        self, two_replicas: ReplicaSet, seq_case: Case, caplog: pytest.LogCaptureFixture
    ) -> None:
        group = two_replicas
        _, model, inputs = seq_case
        rows = [{k: v[i : i + 1] for k, v in inputs.items()} for i in range(3)] * 8
        expected = [call_whole(model, r) for r in rows]
        infos = await group.describe()
        victim = next(i["pid"] for i in infos if (i["replica"], i["stage_index"]) == (0, 1))
        # Stopped, the stage holds every batch its replica is given: those are surely in
        # flight, unanswered, when it dies.
        os.kill(victim, signal.SIGSTOP)
        try:

            async def client(start: int) -> list[dict[str, np.ndarray]]:
                return [await group.run(r) for r in rows[start::4]]

            clients = [asyncio.ensure_future(client(i)) for i in range(4)]
            await _until(lambda: group.inflight[0] > 0)
            held = group.inflight[0]
            os.kill(victim, signal.SIGKILL)
            answers = await asyncio.gather(*clients)
            # Ray restarts the stage (max_restarts): the replica is probed and rejoins.
            await _until(lambda: group.health().healthy == 2)
            after = next(
                i["pid"]
                for i in await group.describe()
                if (i["replica"], i["stage_index"]) == (0, 1)
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)

        assert held > 0
        assert "replica 0 leaves the rotation: a stage process failed" in caplog.text
        for start, got in enumerate(answers):
            for out, want in zip(got, expected[start::4], strict=True):
                _assert_matches(out, want)
        assert after != victim

    async def test_batches_spread_over_both_replicas(
        self, two_replicas: ReplicaSet, seq_case: Case
    ) -> None:
        group = two_replicas
        _, model, inputs = seq_case
        assert group.health().healthy == 2

        def calls(stats: list[dict[str, Any]]) -> dict[tuple[int, int], int]:
            return {(s["replica"], s["stage_index"]): s["calls"] for s in stats}

        before = calls(await group.stats())
        outs = await asyncio.gather(*(group.run(inputs) for _ in range(6)))
        after = calls(await group.stats())

        for out in outs:
            _assert_matches(out, call_whole(model, inputs))
        made = {key: after[key] - before[key] for key in after}
        assert made[(0, 0)] > 0 and made[(1, 0)] > 0
        assert made[(0, 0)] + made[(1, 0)] == 6

    async def test_one_replica_a_killed_stage_under_load_loses_no_request(
        self, two_replicas: ReplicaSet, seq_case: Case, caplog: pytest.LogCaptureFixture
    ) -> None:
        # Last in the class: it scales the set down to the one replica it is about.
        group = two_replicas
        _, model, inputs = seq_case
        assert await group.remove_replica(drain_timeout_s=60.0)
        assert group.replicas == 1 and group.health().healthy == 1
        batcher = Batcher(
            group.run_batch,
            BatchSettings(
                max_batch_size=3, batch_timeout_ms=1.0, max_inflight_batches=3, pad_batches=False
            ),
        )
        await batcher.start()
        rows = [{k: v[i : i + 1] for k, v in inputs.items()} for i in range(3)] * 16
        expected = [call_whole(model, r) for r in rows]
        (info,) = [i for i in await group.describe() if i["stage_index"] == 1]
        victim = info["pid"]
        # Stopped, the stage holds every batch handed to the replica: those are surely in
        # flight, unanswered, when it dies, and the rest queue in the batcher.
        os.kill(victim, signal.SIGSTOP)
        try:

            async def client(start: int) -> list[dict[str, np.ndarray]]:
                return [await batcher.submit(r) for r in rows[start::8]]

            clients = [asyncio.ensure_future(client(i)) for i in range(8)]
            await _until(lambda: sum(group.inflight) >= 3)
            os.kill(victim, signal.SIGKILL)
            answers = await asyncio.gather(*clients)  # Ray restarts the stage meanwhile
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
            await batcher.stop()

        for start, got in enumerate(answers):
            for out, want in zip(got, expected[start::8], strict=True):
                _assert_matches(out, want)
        assert "holding requests for the model's replica" in caplog.text
        assert group.health().recoveries >= 1 and group.health().healthy == 1
        assert batcher.held_rows == 0


@pytest.mark.parametrize(
    ("options", "needed"),
    [
        (PipelineOptions(gpus_per_shard=1), "GPU=2"),
        (PipelineOptions(replicas=3), "CPU=6"),
        (PipelineOptions(stage_resources=({"tpu_host": 1}, {})), "tpu_host=1"),
    ],
)
async def test_missing_resources_raise_instead_of_hanging(
    ray_address: str, seq_case: Case, options: PipelineOptions, needed: str
) -> None:
    with pytest.raises(InsufficientResourcesError, match=needed):
        await ReplicaSet.create(seq_case[0], options)

    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


async def test_placement_that_cannot_be_met_now_times_out_clearly(
    ray_address: str, seq_case: Case
) -> None:
    # The cluster has the CPUs in total, but a placement group holds all of them.
    blocker = ray.util.placement_group([{"CPU": 4}])
    await blocker.ready()
    try:
        with pytest.raises(PipelineStartError, match=r"not ready after 0\.5 s"):
            await ReplicaSet.create(seq_case[0], PipelineOptions(ready_timeout_s=0.5))
    finally:
        ray.util.remove_placement_group(blocker)


async def test_broken_stage_file_names_the_stage(
    ray_address: str, seq_case: Case, tmp_path: Path
) -> None:
    bundle = tmp_path / "broken"
    shutil.copytree(seq_case[0], bundle)
    (bundle / read_manifest(bundle).stages[1].file).write_bytes(b"not a keras file")

    with pytest.raises(PipelineStartError, match="stage 1 of replica 0"):
        await ReplicaSet.create(bundle, PipelineOptions(max_restarts=0))


async def test_stage_file_removed_after_the_driver_read_it_is_shipped(
    ray_address: str, seq_case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle, model, inputs = seq_case
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)

    def ship_then_lose_stage_1(
        bundle_dir: Path, manifest: Manifest, mode: bool | None, away: set[int]
    ) -> list[ShippedStage | None]:
        shipped = ship_bundle(bundle_dir, manifest, mode, away)
        (bundle_dir / manifest.stages[1].file).unlink()
        return shipped

    monkeypatch.setattr(shards.pipeline.placement, "ship_bundle", ship_then_lose_stage_1)
    options = PipelineOptions(
        batch_sizes=(3,), ship_stages=True, stage_cache_dir=str(tmp_path / "cache")
    )
    group = await ReplicaSet.create(copy, options)
    try:
        out = await group.run(inputs)
        infos = await group.describe()
    finally:
        await group.close()

    _assert_matches(out, call_whole(model, inputs))
    assert [i["loaded_from"] for i in infos] == ["local", "shipped"]


@pytest.mark.parametrize(
    ("mode", "away", "shipped"),
    [
        (None, set(), [False, False]),
        (None, {1}, [False, True]),
        (True, set(), [True, True]),
        (False, {0, 1}, [False, False]),
    ],
)
def test_ship_bundle_ships_what_the_mode_and_placement_ask(
    ray_address: str, seq_case: Case, mode: bool | None, away: set[int], shipped: list[bool]
) -> None:
    bundle = seq_case[0]

    result = ship_bundle(bundle, read_manifest(bundle), mode, away)

    assert [s is not None and len(s.payload) == 1 for s in result] == shipped


async def test_stages_off_node_compares_bundle_nodes_with_the_driver(ray_address: str) -> None:
    group = ray.util.placement_group([{"CPU": 0.5}, {"CPU": 0.5}])
    await group.ready()
    try:
        here = stages_off_node([group], ray.get_runtime_context().get_node_id())
        elsewhere = stages_off_node([group], "f" * 56)
    finally:
        ray.util.remove_placement_group(group)

    assert (here, elsewhere) == (set(), {0, 1})


class _FakeGroup:
    bundle_count = 2


def _fake_pipeline() -> Replica:
    return Replica(["actor-0", "actor-1"], (), {}, _FakeGroup())  # type: ignore[arg-type]


def test_close_gives_up_on_a_ray_that_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    unblock, released = threading.Event(), threading.Event()
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: unblock.wait())
    monkeypatch.setattr(shards.pipeline.replica, "remove_placement_group", lambda _: released.set())
    try:
        assert _fake_pipeline().close(timeout_s=0.05) is False
    finally:
        # Let the abandoned thread finish while the fakes are still in place.
        unblock.set()
        released.wait()


def test_close_logs_failures_and_still_frees_the_placement_group(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    removed: list[Any] = []

    def kill(actor: str, no_restart: bool) -> None:
        raise ConnectionError(f"GCS gone while killing {actor}")

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "kill", kill)
    monkeypatch.setattr(shards.pipeline.replica, "remove_placement_group", removed.append)
    pipeline = _fake_pipeline()

    assert pipeline.close() is True
    assert pipeline.close() is True

    assert removed == [pipeline.placement_group]
    assert "killing shard actor actor-0 failed" in caplog.text
    assert "GCS gone while killing actor-1" in caplog.text


# The bundle, its inputs and the whole model's outputs come from this process (which has
# TensorFlow loaded already): the child, a driver of a Ray that declares 2 GPUs, loads none.
_GPU_SCRIPT = """
import asyncio, json, sys
import numpy as np
import ray
from shards.pipeline.replica_set import ReplicaSet, PipelineOptions

async def main():
    group = await ReplicaSet.create(sys.argv[1], PipelineOptions(gpus_per_shard=1))
    try:
        batch, whole = dict(np.load(sys.argv[2])), dict(np.load(sys.argv[3]))
        out = await group.run(batch)
        diff = max(float(np.abs(out[n] - whole[n]).max()) for n in whole)
        print("RESULT " + json.dumps({"infos": await group.describe(), "diff": diff}))
    finally:
        await group.close()

ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False)
asyncio.run(main())
ray.shutdown()
"""


def test_declared_gpus_give_each_shard_its_own_gpu(tmp_path: Path, seq_case: Case) -> None:
    bundle, model, inputs = seq_case
    np.savez(tmp_path / "inputs.npz", **inputs)  # type: ignore[arg-type]
    np.savez(tmp_path / "whole.npz", **call_whole(model, inputs))  # type: ignore[arg-type]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    script = tmp_path / "gpu_pipeline.py"
    script.write_text(textwrap.dedent(_GPU_SCRIPT))
    argv = [str(bundle), str(tmp_path / "inputs.npz"), str(tmp_path / "whole.npz")]
    proc = subprocess.run(
        [sys.executable, str(script), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))

    infos = result["infos"]
    assert [len(i["gpu_ids"]) for i in infos] == [1, 1]
    assert len({i["gpu_ids"][0] for i in infos}) == 2
    assert len({i["cuda_visible_devices"] for i in infos}) == 2
    # Declared GPUs that TensorFlow cannot see run on the CPU; on a GPU machine the shard whose
    # id names a real device runs on it.
    for info in infos:
        assert info["device"] == ("/GPU:0" if info["visible_gpus"] else "/CPU:0")
        assert info["intra_op_threads"] == 1
    assert result["diff"] <= 1e-5
