"""Version switches on real Ray actors (the session's Ray), the app in process, one replica each.

- ``plain`` (no ``[traffic]``): version 2 appears while two clients keep sending; every request
  is answered 200, and none sent after version 1 was unloaded is answered by it (the one-replica
  hand-over); version 1's cached bundle is then free (``shardserve cache list`` says not in
  use) and ``shardserve cache prune`` removes it. A version 3 that cannot load (a ``.keras``
  naming a layer that does not exist) leaves version 2 serving, with its reason in the index.
- ``slow`` (``[traffic]`` 50/50): a canary that computes far longer per row than the stable
  version (it stretches each row 16000 times before its dense layers: ~200 ms a row against ~7) is rolled back on its p99,
  kept loaded, and counted as ``latency`` in ``shardserve_rollbacks_total``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path

import keras
import pytest

from serving.version.life import VersionState
from shards.partition.demo_models import build_demo
from tests.e2e.inprocess import app_in_process
from tests.e2e.repository_app import add_version, first_versions, repository_settings, until

ROW = [3, 14, 5, 9]
SLOW_CONFIG = """stages = 1
[traffic]
stable = 50
canary = 50
[canary]
window_s = 60
min_requests = 6
"""


def slow_tokens() -> keras.Model:
    """demo-tokens' signature, ~30x its compute: each row stretched to 16000x its length."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(64, 16, name="embedding")(tokens)
    x = keras.layers.UpSampling1D(16000, name="stretch")(x)
    x = keras.layers.Dense(256, activation="relu", name="wide")(x)
    x = keras.layers.Dense(256, activation="relu", name="wider")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(tokens, keras.layers.Dense(4, name="logits")(x), name="slow_tokens")


def cache_view(cache_dir: Path, root: Path) -> tuple[dict[str, str], list[str]]:
    """``shardserve cache list``'s in-use column per bundle (by the version of ``root`` it was
    cut from: ``plain/1``), then what ``shardserve cache prune --all`` removed."""
    from typer.testing import CliRunner

    from serving.cli.main import app
    from shards.bundle import cache

    cut_from = {
        hashlib.sha256(m.read_bytes()).hexdigest(): f"{m.parent.parent.name}/{m.parent.name}"
        for m in root.glob("*/*/m.keras")
    }
    keys = {
        e.key: cut_from[json.loads((e.path / "manifest.json").read_text())["source_sha256"]]
        for e in cache.entries(cache_dir)
    }
    listed = CliRunner().invoke(app, ["cache", "list", "--cache-dir", str(cache_dir)])
    assert listed.exit_code == 0, listed.output
    in_use = {}
    for line in listed.output.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells[0] in keys:
            in_use[keys[cells[0]]] = cells[-1]
    pruned = CliRunner().invoke(app, ["cache", "prune", "--all", "--cache-dir", str(cache_dir)])
    assert pruned.exit_code == 0, pruned.output
    gone = sorted(keys[k] for k in keys if not (cache_dir / k).exists())
    return in_use, gone


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    tokens = build_demo("demo-tokens")
    stable = build_demo("demo-tokens")
    # Weights of its own, so a bundle of its own: plain's version 1 then shares its bundle with
    # no other version, and the cache frees it once that version is retired.
    logits = stable.get_layer("logits")
    logits.bias.assign(logits.bias + 1.0)
    models = {"plain": (tokens, "stages = 1\n"), "slow": (stable, SLOW_CONFIG)}
    return first_versions(tmp_path / "repository", models)


async def test_a_switch_under_load_drops_nothing_and_a_slow_canary_rolls_back(
    repository: Path, ray_address: str, tmp_path: Path
) -> None:
    settings = repository_settings(repository, ray_address, tmp_path / "cache", 0.5)
    body = {"inputs": [{"name": "tokens", "shape": [1, 4], "datatype": "INT32", "data": ROW}]}
    async with app_in_process(settings) as (state, client):

        async def infer(name: str) -> tuple[float, int, str]:
            sent = time.monotonic()
            reply = await client.post(f"/v2/models/{name}/infer", json=body)
            version = reply.json().get("model_version", "") if reply.status_code == 200 else ""
            return sent, reply.status_code, version or reply.text

        answers: list[tuple[float, int, str]] = []
        switched: list[float] = []
        done = asyncio.Event()

        async def keep_sending() -> None:
            while not done.is_set():
                answers.append(await infer("plain"))

        clients = [asyncio.create_task(keep_sending()) for _ in range(2)]
        await until(lambda: len(answers) >= 10, "answers from version 1")
        add_version(repository, "plain", 2, build_demo("demo-tokens"))
        await state.repository.poll_once()
        await until(lambda: list(state.models["plain"]) == ["2"], "version 1 unloaded")
        switched.append(time.monotonic())
        await until(lambda: len([a for a in answers if a[0] > switched[0]]) >= 10, "after")
        done.set()
        await asyncio.gather(*clients)
        # Version 1's bundle is no longer served: the cache lists it free, a prune takes it.
        cached = cache_view(settings.cache_dir, repository)

        add_version(repository, "plain", 3, None)
        await state.repository.poll_once()
        await until(
            lambda: state.model("plain", "3").state is not VersionState.LOADING,
            "version 3 failed",
        )
        after_failure = [await infer("plain") for _ in range(3)]
        index = {
            (e["name"], e["version"]): (e["state"], e["reason"])
            for e in (await client.post("/v2/repository/index", json={})).json()
        }

        add_version(repository, "slow", 2, slow_tokens())
        await state.repository.poll_once()
        await until(lambda: state.repository.rollouts["slow"].canary == "2", "version 2 the canary")
        slow: list[tuple[float, int, str]] = []
        while state.repository.rollouts["slow"].state != "rolled_back":
            assert len(slow) < 300, "the slow canary was not rolled back"
            slow.append(await infer("slow"))
        rolled = state.repository.rollouts["slow"]
        rolled_back = (rolled.weights, rolled.reason or "")
        metrics = (await client.get("/metrics")).text

    failed = [a for a in answers + slow if a[1] != 200]
    assert not failed, failed[:5]
    assert cached == ({"plain/1": "no", "plain/2": "yes", "slow/1": "yes"}, ["plain/1"])
    versions = [v for _, _, v in answers if v in ("1", "2")]
    assert "1" in versions and "2" in versions
    late = [a for a in answers if a[0] > switched[0] and a[2] == "1"]
    assert not late, f"answered by version 1 after it was unloaded: {late[:3]}"
    assert [(code, v) for _, code, v in after_failure] == [(200, "2")] * 3
    state3, reason3 = index[("plain", "3")]
    assert state3 == "UNAVAILABLE" and reason3 and "Traceback" not in reason3
    assert index[("plain", "2")] == ("READY", "")
    assert rolled_back[0] == (50, 0)
    assert rolled_back[1].startswith("rolled back: canary p99"), rolled_back[1]
    assert 'shardserve_rollbacks_total{model="slow",reason="latency",version="2"} 1.0' in metrics
