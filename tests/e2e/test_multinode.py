"""A real two-node Ray cluster on this one machine, and a 2-stage model served across it.

Two raylets (`ray start --head` with the custom resource node_a, a second `ray start --address`
with node_b) in a private temp dir with ports of their own, so the test session's own Ray is not
touched. `shardserve serve --stage-resources` pins stage 0 to node_a and stage 1 to node_b; the
GCS actor table then shows where the ShardActors really run. Teardown kills only the processes
this module started: `ray stop` would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest

from tests.serverproc import BIN, free_ports, ray_env, running_server

NODE_START_TIMEOUT_S = 120.0
STAGE_RESOURCES = [{"node_a": 0.01}, {"node_b": 0.01}]
# Per node: one shard actor, and the head also runs the partitioning task.
WORKER_PORTS_PER_NODE = 12

# Run in a separate interpreter: this pytest process may already be a driver of the session's
# own Ray, and one process can be connected to one cluster only. The GCS actor table needs no
# dashboard (which these nodes do not run), unlike ray.util.state.
_PROBE = """
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="error")
from ray._private import state
nodes = {n["NodeID"]: sorted(n["Resources"]) for n in ray.nodes() if n["Alive"]}
actors = [
    {"class": a["ActorClassName"], "state": a["State"], "node": a["Address"]["NodeID"]}
    for a in state.actors().values()
]
print(json.dumps({"nodes": nodes, "actors": actors}))
ray.shutdown()
"""


class _RayNode:
    """`ray start --block`: the process lives as long as the node, so its tree is ours to kill."""

    def __init__(self, args: list[str]) -> None:
        self.output: list[str] = []
        self.started = threading.Event()
        self.proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--block", *args],
            env=ray_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if "Ray runtime started" in line:
                self.started.set()
        self.started.set()  # exited: wake the waiter, which then sees the dead process

    def wait_started(self) -> None:
        if not self.started.wait(NODE_START_TIMEOUT_S) or self.proc.poll() is not None:
            raise RuntimeError(
                f"ray start {self.proc.args!r} did not start:\n{''.join(self.output[-40:])}"
            )


def _node_args(temp_dir: str, resources: dict[str, float]) -> list[str]:
    node_manager, object_manager, agent, agent_grpc, env_agent, metrics, *workers = free_ports(
        6 + WORKER_PORTS_PER_NODE
    )
    return [
        "--node-ip-address=127.0.0.1",
        "--num-cpus=2",
        "--num-gpus=0",
        f"--resources={json.dumps(resources)}",
        "--object-store-memory=100000000",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={env_agent}",
        f"--metrics-export-port={metrics}",
        f"--worker-port-list={','.join(map(str, workers))}",
    ]


def _kill_tree(roots: list[psutil.Process], marker: str) -> None:
    """SIGTERM, then SIGKILL, the roots, their descendants, and any process whose command line
    names our private temp dir (a raylet's workers can outlive their parent's listing)."""
    procs: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            procs[root.pid] = root
            procs.update({p.pid: p for p in root.children(recursive=True)})
        except psutil.NoSuchProcess:
            continue
    for proc in psutil.process_iter(["cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or []):
            procs[proc.pid] = proc
    procs.pop(os.getpid(), None)
    for proc in procs.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    # A short grace: these nodes hold nothing to save, and gcs_server and the `ray start`
    # processes outlive a SIGTERM by 20 s and more when their whole cluster goes at once.
    _, alive = psutil.wait_procs(list(procs.values()), timeout=3)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    # Short path: Ray's unix sockets live under it and sun_path holds only 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="ssray", dir="/tmp")
    gcs_port, client_port = free_ports(2)
    address = f"127.0.0.1:{gcs_port}"
    nodes: list[_RayNode] = []
    try:
        head = _RayNode(
            [
                "--head",
                f"--port={gcs_port}",
                f"--ray-client-server-port={client_port}",
                "--include-dashboard=false",
                *_node_args(temp_dir, {"node_a": 1}),
            ]
        )
        nodes.append(head)
        head.wait_started()
        worker = _RayNode([f"--address={address}", *_node_args(temp_dir, {"node_b": 1})])
        nodes.append(worker)
        worker.wait_started()
        yield address
    finally:
        _kill_tree([psutil.Process(n.proc.pid) for n in nodes if n.proc.poll() is None], temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@dataclass
class Served:
    url: str
    address: str
    model_path: Path


def _tiny_model(path: Path) -> None:
    import keras

    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((8,), name="features"),
            keras.layers.Dense(16, activation="relu", name="d1"),
            keras.layers.Dense(16, activation="relu", name="d2"),
            keras.layers.Dense(8, activation="relu", name="d3"),
            keras.layers.Dense(4, name="logits"),
        ],
        name="tiny",
    )
    model.save(path)


@pytest.fixture(scope="module")
def served(cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("multinode")
    model_path = work / "tiny.keras"
    _tiny_model(model_path)
    args = [
        "--model", str(model_path),
        "--stages", "2",
        "--stage-resources", json.dumps(STAGE_RESOURCES),
        "--ray-address", cluster,
        "--cache-dir", str(work / "cache"),
    ]  # fmt: skip
    with running_server(args, work) as server:
        yield Served(url=server.url, address=cluster, model_path=model_path)


def _probe(address: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, address],
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    probed: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return probed


def test_stages_run_on_the_nodes_they_were_pinned_to(served: Served) -> None:
    probed = _probe(served.address)
    node_of = {name: node for node, resources in probed["nodes"].items() for name in resources}
    shard_nodes = sorted(
        a["node"] for a in probed["actors"] if a["class"] == "ShardActor" and a["state"] == "ALIVE"
    )
    assert len(probed["nodes"]) == 2
    assert shard_nodes == sorted([node_of["node_a"], node_of["node_b"]])


def test_predictions_match_the_model_run_in_process(served: Served) -> None:
    import keras

    rows = np.random.default_rng(3).normal(size=(5, 8)).astype("float32")
    expected = keras.saving.load_model(served.model_path).predict(rows, verbose=0)
    response = httpx.post(f"{served.url}/predict", json={"instances": rows.tolist()}, timeout=60.0)
    assert response.status_code == 200, response.text
    predictions = np.asarray(response.json()["predictions"], dtype="float32")
    np.testing.assert_allclose(predictions, expected, rtol=1e-5, atol=1e-6)


def test_metadata_reports_two_stages(served: Served) -> None:
    response = httpx.get(f"{served.url}/v1/models/tiny/metadata", timeout=10.0)
    assert response.status_code == 200, response.text
    assert response.json()["num_stages"] == 2
