"""A model repository of two demo models on real Ray actors (the session's Ray), the app in
process: both serve at once, each answering as Keras does; one unloaded through the repository
manager while requests to the other run ends its actors, and the other keeps serving."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
import ray

from shards.partition.demo_models import build_demo

TINY = np.arange(16, dtype=np.float32).reshape(2, 8) / 10
TOKENS = np.array([[3, 14, 15, 9], [26, 5, 0, 0]], dtype=np.int32)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    for name, demo in (("tiny", "demo-tiny"), ("tokens", "demo-tokens")):
        (root / name / "1").mkdir(parents=True)
        build_demo(demo).save(root / name / "1" / f"{name}.keras")
    return root


async def test_two_models_serve_at_once_and_one_unloads_while_the_other_serves(
    repository: Path, ray_address: str, tmp_path: Path
) -> None:
    from asgi_lifespan import LifespanManager

    from serving.config import Settings
    from serving.server.app import create_app

    settings = Settings(
        model_repository=repository,
        ray_address=ray_address,
        cache_dir=tmp_path / "cache",
        max_batch_size=4,
        batch_timeout_ms=0,
        cpus_per_shard=1,
        max_sequence_length=16,
    )
    app = create_app(settings)
    async with LifespanManager(app, startup_timeout=30, shutdown_timeout=60) as manager:
        state = app.state.shardserve
        await asyncio.wait_for(asyncio.gather(*(m.wait_load() for m in state.served())), 120)
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

            async def predict(name: str, rows: np.ndarray) -> httpx.Response:
                body = {"instances": rows.tolist()}
                return await client.post(f"/v1/models/{name}:predict", json=body, timeout=60)

            tiny, tokens = await asyncio.gather(predict("tiny", TINY), predict("tokens", TOKENS))
            assert tiny.status_code == 200, tiny.text
            assert tokens.status_code == 200, tokens.text
            index = {e["name"]: (e["state"], e["reason"]) for e in state.repository.index()}
            assert index == {"tiny": ("READY", ""), "tokens": ("READY", "")}
            # Its stage actors, to see them end (the runner drops its handles at close).
            actors = [a for p in state.model("tiny").runner._pipelines for a in p.actors]

            unload = asyncio.create_task(state.repository.unload("tiny"))
            during = await asyncio.gather(*(predict("tokens", TOKENS) for _ in range(4)))
            await asyncio.wait_for(unload, 60)
            after = await predict("tokens", TOKENS)
            gone = await predict("tiny", TINY)
            ready = await client.get("/readyz")
            index = {e["name"]: (e["state"], e["reason"]) for e in state.repository.index()}

    np.testing.assert_allclose(
        tiny.json()["predictions"], build_demo("demo-tiny")(TINY), rtol=1e-5, atol=1e-6
    )
    want = np.asarray(build_demo("demo-tokens")(TOKENS))
    for answer in [tokens, *during, after]:
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(answer.json()["predictions"], want, rtol=1e-5, atol=1e-6)
    assert gone.status_code == 404
    assert "model 'tiny' is not served (unloaded through the repository API)" in gone.text
    for actor in actors:  # killed at the unload
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.__ray_ready__.remote(), timeout=30)
    assert (ready.status_code, ready.json()) == (200, {"status": "ready", "model": "tokens"})
    assert index == {
        "tiny": ("UNAVAILABLE", "unloaded through the repository API"),
        "tokens": ("READY", ""),
    }
