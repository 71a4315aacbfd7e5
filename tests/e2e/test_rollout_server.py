"""Canaries on real Ray actors (the session's Ray), the app in process: a model repository with
``[traffic]`` 50/50 and auto promotion. Version 2 is the token model cut down to an embedding of
20 ids: TensorFlow raises on any larger id, so the requests the stable version answers fail on
the canary (422). It is rolled back on errors once its failures are significant, kept loaded, the
index and the metric say so; version 3 (the stable's model again) replaces it, holds for its
window and is promoted on its own, and the old stable's actors end; no request to a good
version fails throughout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import keras
import numpy as np
import pytest
import ray

from shards.partition.demo_models import build_demo
from tests.e2e.inprocess import app_in_process
from tests.e2e.repository_app import add_version, first_versions, repository_settings, until

ROW = [3, 14, 55, 9]  # 55: outside version 2's 20 ids
CONFIG = """stages = 1
[traffic]
stable = 50
canary = 50
[canary]
window_s = 3
min_requests = 6
promote = "auto"
latency_factor = 1000.0
"""
# Judged on errors and promotion: a p99 of a loaded machine (a new version's first batches on
# shared cores) is not this test's subject; the latency rule's are tests/serving/canary's.


def narrow_tokens() -> keras.Model:
    """demo-tokens with an embedding of 20 ids (a vocabulary cut by mistake)."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(20, 16, mask_zero=True, name="embedding")(tokens)
    x = keras.layers.Dense(32, activation="relu", name="hidden")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(tokens, keras.layers.Dense(4, name="logits")(x), name="narrow_tokens")


def actors(model: Any) -> list[Any]:
    """A served version's stage actors (its ``ReplicaSet``'s replicas')."""
    return [a for replica in model.runner._replicas.values() for a in replica.actors]


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    return first_versions(tmp_path / "repository", {"m": (build_demo("demo-tokens"), CONFIG)})


async def test_a_failing_canary_rolls_back_and_a_good_one_is_promoted_on_its_own(
    repository: Path, ray_address: str, tmp_path: Path
) -> None:
    settings = repository_settings(repository, ray_address, tmp_path / "cache", 1)
    want = np.asarray(build_demo("demo-tokens")(np.array([ROW], np.int32)))
    async with app_in_process(settings) as (state, client):

        async def send(n: int) -> list[httpx.Response]:
            body = {"instances": [ROW]}
            return [await client.post("/v1/models/m:predict", json=body) for _ in range(n)]

        async def index() -> dict[str, tuple[str, str]]:
            found = (await client.post("/v2/repository/index", json={})).json()
            return {e["version"]: (e["state"], e["reason"]) for e in found}

        add_version(repository, "m", 2, narrow_tokens())
        await state.repository.poll_once()
        await until(lambda: state.repository.rollouts["m"].canary == "2", "version 2 the canary")
        rolled = state.repository.rollouts["m"]
        during: list[httpx.Response] = []
        while rolled.state == "canary" and len(during) < 400:  # the split draws each side
            during += await send(1)
        after = await send(8)
        rolled_back = (rolled.state, rolled.weights, rolled.reason)
        after_rollback = await index()
        metrics = (await client.get("/metrics")).text
        # Their stage actors, to see them end (a runner drops its handles at close).
        v1_actors, v2_actors = actors(state.model("m", "1")), actors(state.model("m", "2"))

        add_version(repository, "m", 3, build_demo("demo-tokens"))
        await state.repository.poll_once()
        await until(lambda: state.repository.rollouts["m"].canary == "3", "version 3 the canary")
        promoted: list[httpx.Response] = []
        while state.repository.rollouts["m"].stable != "3":  # auto: after a whole window
            now = state.repository.rollouts["m"]
            assert len(promoted) < 2000, f"version 3 was not promoted: {now.state} {now.reason}"
            promoted += await send(4)
        await until(lambda: list(state.models["m"]) == ["3"], "versions 1 and 2 unloaded")
        promoted += await send(4)
        final = await index()
        labels = dict(state.labels["m"])

    codes = [r.status_code for r in during]
    assert set(codes) == {200, 422} and codes[-1] == 422 and codes.count(422) >= 6, codes
    assert [r.status_code for r in after] == [200] * 8
    assert rolled_back[:2] == ("rolled_back", (50, 0))
    why = rolled_back[2]
    assert why is not None
    assert why.startswith("rolled back: canary failure rate 1.00 > stable 0.00 + 0.02 over ")
    assert after_rollback == {"1": ("READY", ""), "2": ("READY", why)}
    assert 'shardserve_rollbacks_total{model="m",reason="errors",version="2"} 1.0' in metrics
    assert "the model failed on this input" in during[-1].json()["error"]
    for answer in [r for r in during if r.status_code == 200] + after + promoted:
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(answer.json()["predictions"], want, rtol=1e-5, atol=1e-6)
    assert v1_actors and v2_actors
    for actor in v1_actors + v2_actors:  # the old stable and the replaced canary: ended
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.__ray_ready__.remote(), timeout=30)
    assert final == {
        "1": ("UNAVAILABLE", "not selected by its version policy (latest 1)"),
        "2": ("UNAVAILABLE", "not selected by its version policy (latest 1)"),
        "3": ("READY", ""),
    }
    assert labels == {"stable": "3"}
