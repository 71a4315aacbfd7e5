"""Memory back on unload (issue 20): a model of more than 1 GiB of float32 weights, served in 2
stages through the real runner on the session's Ray, then unloaded by the repository manager: its stage actors' processes
are gone and what the server's processes and its Ray hold (``held_bytes``) is back within 100 MiB
of what it was before the load. TensorFlow never gives memory back inside a process; a version that
lives in its own actors gives everything back when they end.

While it is served, lean loading (issues 12, 27): each stage actor holds at most 1.25x its weights
above its own RSS once TensorFlow was imported, as the server's /metrics reports them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.repository.manager import Repository
from serving.server.state import ServerState
from serving.settings.config import Settings
from serving.version.life import VersionState
from serving.version.runner import build_runner
from shards.bundle.format import read_manifest
from tests.serverproc import ray_env

MiB = 2**20
GiB = 2**30
WIDE, NARROW = 16384, 8192  # two Dense layers of 16384 x 8192 float32: 512 MiB each
TOLERANCE = 100 * MiB
LEAN = 1.25  # most RSS above the actor's TensorFlow baseline per byte of its weights

# Built and cut in a child process, which then exits: the test process never holds the weights.
# Zero kernels: nothing to draw, the bytes are the same.
_BUILD = f"""
import sys, keras
from shards.partition.cut import partition_to_bundle
x = keras.Input(({WIDE},))
h = keras.layers.Dense({NARROW}, kernel_initializer="zeros", name="a")(x)
y = keras.layers.Dense({WIDE}, kernel_initializer="zeros", name="b")(h)
partition_to_bundle(keras.Model(x, y), sys.argv[1], stages=2, plan_batch_rows=1)
"""


@pytest.fixture(scope="module")
def big_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("big")
    subprocess.run([sys.executable, "-c", _BUILD, str(out)], check=True, env=ray_env(), timeout=300)
    return out


def above_tensorflow(metrics: str) -> dict[str, tuple[float, float]]:
    """stage -> (weights, RSS above the actor's TensorFlow baseline), from /metrics."""
    kinds: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name == "shardserve_stage_memory_bytes":
            for sample in family.samples:
                kinds.setdefault(sample.labels["stage"], {})[sample.labels["kind"]] = sample.value
    return {
        stage: (k["weights"], k["measured"] - k["tensorflow_baseline"])
        for stage, k in kinds.items()
    }


def held_bytes() -> int:
    """What this test's server holds: the anonymous pages of this process and its descendants
    (its Ray: GCS, raylet, workers, the stage actors), each page shared between processes split
    between them, plus every shared-memory page of the machine (tmpfs and Ray's object store,
    where a page an ended actor wrote stays, mapped by no one). Not the machine's used memory:
    on this VM that less what every process holds (kernel memory: page tables, socket buffers,
    pages on per-CPU free lists or out for the balloon's free-page reporting) read 299 to 722 MiB
    and moved by 420 MiB between two reads while this test's processes moved by 16 MiB: the
    suite's +240 and +266 MiB failures had no process of the test holding the difference."""
    meminfo = Path("/proc/meminfo").read_text()
    shmem = next(line for line in meminfo.splitlines() if line.startswith("Shmem:"))
    return sum(size for _, size in processes(mine=True).values()) + int(shmem.split()[1]) * 1024


def processes(mine: bool = False) -> dict[int, tuple[str, int]]:
    """pid -> (name, bytes it holds: ``_held``) of every process, or of this one and its
    descendants."""
    parents: dict[int, int] = {}
    found: dict[int, tuple[str, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            lines = (entry / "status").read_text().splitlines()
        except OSError:
            continue  # ended meanwhile
        status = {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}
        parents[int(entry.name)] = int(status["PPid"])
        found[int(entry.name)] = (status["Name"], _held(entry, status))
    if not mine:
        return found
    ours = {os.getpid()}
    while grown := {pid for pid, parent in parents.items() if parent in ours} - ours:
        ours |= grown
    return {pid: found[pid] for pid in ours if pid in found}


def _held(entry: Path, status: dict[str, str]) -> int:
    """A process's anonymous pages, each shared page split between its sharers where /proc says
    so (its shared-memory pages are in ``held_bytes``'s Shmem)."""
    try:
        for line in (entry / "smaps_rollup").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "Pss_Anon":
                return int(value.split()[0]) * 1024
    except OSError:  # not ours to read: its resident anonymous pages, unsplit
        pass
    return int(status.get("RssAnon", "0 kB").split()[0]) * 1024


def grown(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> str:
    """This test's processes that hold more than before, for a failure's message."""
    rows = [
        f"{name} (pid {pid}) +{(size - before.get(pid, ('', 0))[1]) / MiB:.0f} MiB"
        for pid, (name, size) in after.items()
        if size - before.get(pid, ("", 0))[1] > 10 * MiB
    ]
    return "; ".join(rows) or "none of this test's processes grew by 10 MiB"


def shard_pids() -> set[int]:
    from ray._private import state

    return {
        int(a["Pid"])
        for a in state.actors().values()
        if a["ActorClassName"] == "ShardActor" and a["State"] == "ALIVE"
    }


async def until(check: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:  # type: ignore[operator]
        await asyncio.sleep(0.2)  # another process's end: there is no event to wait on


async def test_unloading_a_1gib_model_ends_its_actors_and_gives_the_memory_back(
    ray_address: str, big_bundle: Path, tmp_path: Path
) -> None:
    weights = read_manifest(big_bundle).total_param_bytes
    assert weights > GiB
    settings = Settings(
        model=str(big_bundle),
        model_name="big",
        ray_address=ray_address,
        max_batch_size=1,
        cache_dir=tmp_path,
    )
    state = ServerState(settings=settings)
    repository = Repository(state, settings, build_runner)
    others = shard_pids()
    started = time.monotonic()
    before, ours_before = held_bytes(), processes(mine=True)

    await repository.start()
    try:
        model = state.model("big")
        await asyncio.wait_for(model.wait_load(), 120)
        assert model.state is not VersionState.FAILED, model.reason
        loaded = held_bytes()
        pids = shard_pids() - others
        lean = above_tensorflow(state.metrics.render().decode())
        name = model.signature.inputs[0].name
        answer = await model.require_batcher().submit(
            {name: np.ones((1, WIDE), np.float32)}, request_id="r-1"
        )
        # The manager's unload: refuse, answer what is held, end the actors, forget the version.
        await repository.unload("big")
    finally:
        if state.served():  # a failure above must not leave its actors behind
            await repository.unload("big")
    await until(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 30.0)
    # Ray may start an idle worker in the place of an ended actor: give it time to settle.
    await until(lambda: held_bytes() - before <= TOLERANCE, 10.0)
    after = held_bytes()
    took = time.monotonic() - started

    print(
        f"\nweights {weights / GiB:.2f} GiB; held before {before / MiB:.0f} MiB, "
        f"loaded +{(loaded - before) / MiB:.0f} MiB, after unload {(after - before) / MiB:+.0f} "
        f"MiB; load + answer + unload {took:.1f} s; grown: {grown(ours_before, processes(True))}; "
        f"RSS above TensorFlow / weights: {[f'{h / w:.2f}x' for w, h in lean.values()]}"
    )
    assert np.asarray(next(iter(answer.values()))).shape == (1, WIDE)
    assert len(pids) == 2
    # Issue 27: oneDNN's pool kept the layers' initial values, 2.09x above TensorFlow here.
    assert sorted(lean) == ["0", "1"] and all(w > 256 * MiB for w, _ in lean.values()), lean
    assert all(held <= LEAN * w for w, held in lean.values()), {
        stage: f"{held / w:.2f}x of {w / MiB:.0f} MiB" for stage, (w, held) in lean.items()
    }
    assert loaded - before > weights  # the actors really held the weights
    assert [p for p in pids if Path(f"/proc/{p}").exists()] == []
    assert not pids & shard_pids()
    assert state.served() == []
    assert b'model="big"' not in state.metrics.render()  # its series went with it
    assert after - before <= TOLERANCE, grown(ours_before, processes(mine=True))
