"""A model repository on real Ray actors (the session's Ray), the app in process with its gRPC
port: two models serve at once, each answering as Keras does, by version and by label; a broken
version is refused with its reason while the others serve; a half-written version is ignored
until it is whole, then polling serves it; one model unloaded through the HTTP repository API
while requests to the other run ends its actors, and a load through gRPC brings it back."""

from __future__ import annotations

import asyncio
import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest
import ray

from shards.partition.demo_models import build_demo
from tests.e2e.inprocess import app_in_process
from tests.serverproc import free_ports

TINY = np.arange(16, dtype=np.float32).reshape(2, 8) / 10
TOKENS = np.array([[3, 14, 15, 9], [26, 5, 0, 0]], dtype=np.int32)
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    for name, demo in (("tiny", "demo-tiny"), ("tokens", "demo-tokens")):
        (root / name / "1").mkdir(parents=True)
        build_demo(demo).save(root / name / "1" / f"{name}.keras")
    (root / "tokens" / "config.toml").write_text("[labels]\nstable = 1\n")
    # Version 2 of tokens, half copied: the first bytes of the file, no zip directory yet.
    whole = (root / "tokens" / "1" / "tokens.keras").read_bytes()
    (root / "tokens" / "2").mkdir()
    (root / "tokens" / "2" / "tokens.keras").write_bytes(whole[: len(whole) // 2])
    # A complete .keras file whose model cannot be read.
    (root / "broken" / "1").mkdir(parents=True)
    with zipfile.ZipFile(root / "broken" / "1" / "broken.keras", "w") as broken:
        broken.writestr("config.json", '{"class_name": "NoSuchLayer", "config": {}}')
        broken.writestr("metadata.json", "{}")
    return root


async def test_a_repository_serves_loads_and_unloads_models_and_versions(
    repository: Path, ray_address: str, tmp_path: Path
) -> None:
    from tritonclient.grpc.aio import InferenceServerClient

    from serving.settings.config import Settings

    (grpc_port,) = free_ports(1)
    settings = Settings(
        model_repository=repository,
        default_model="tokens",
        ray_address=ray_address,
        cache_dir=tmp_path / "cache",
        admin_token=TOKEN,
        grpc_port=grpc_port,
        max_batch_size=4,
        batch_timeout_ms=0,
        cpus_per_shard=1,
        max_sequence_length=16,
    )
    async with app_in_process(settings) as (state, client):

        async def predict(path: str, rows: np.ndarray) -> httpx.Response:
            body = {"instances": rows.tolist()}
            url = path if path == "/predict" else f"{path}:predict"
            return await client.post(url, json=body, timeout=60)

        async def index() -> dict[tuple[str, str], tuple[str, str]]:
            r = await client.post("/v2/repository/index", json={})
            assert r.status_code == 200, r.text
            return {(e["name"], e.get("version", "")): (e["state"], e["reason"]) for e in r.json()}

        tiny, tokens, stable = await asyncio.gather(
            predict("/v1/models/tiny", TINY),
            predict("/v1/models/tokens/versions/1", TOKENS),
            predict("/v1/models/tokens/labels/stable", TOKENS),
        )
        first = await index()
        # Its stage actors, to see them end (the runner drops its handles at close).
        actors = [a for p in state.model("tiny").runner._pipelines for a in p.actors]

        unload = asyncio.create_task(
            client.post("/v2/repository/models/tiny/unload", headers=AUTH, timeout=60)
        )
        during = await asyncio.gather(*(predict("/predict", TOKENS) for _ in range(4)))
        unloaded = await asyncio.wait_for(unload, 60)
        gone = await predict("/v1/models/tiny", TINY)
        held = await index()

        # Load it back through gRPC, as tritonclient does.
        grpc_client = InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            await grpc_client.load_model("tiny", headers={"authorization": f"Bearer {TOKEN}"})
        finally:
            await grpc_client.close()
        back = await predict("/v1/models/tiny", TINY)

        # The half-written version becomes whole: polling serves it (policy latest, n=1).
        whole = repository / "tokens" / "1" / "tokens.keras"
        staged = repository / "tokens" / ".incoming.keras"
        staged.write_bytes(whole.read_bytes())
        staged.replace(repository / "tokens" / "2" / "tokens.keras")
        await state.repository.poll_once()
        await asyncio.wait_for(state.model("tokens", "2").wait_load(), 120)
        second = await predict("/v1/models/tokens/versions/2", TOKENS)
        last = await index()
        ready = await client.get("/readyz")

    want_tiny = np.asarray(build_demo("demo-tiny")(TINY))
    want_tokens = np.asarray(build_demo("demo-tokens")(TOKENS))
    for answer, want in [(tiny, want_tiny), (back, want_tiny)] + [
        (r, want_tokens) for r in (tokens, stable, *during, second)
    ]:
        assert answer.status_code == 200, (answer.request.url, answer.text)
        np.testing.assert_allclose(answer.json()["predictions"], want, rtol=1e-5, atol=1e-6)
    assert first[("tiny", "1")] == ("READY", "")
    assert first[("tokens", "1")] == ("READY", "")
    assert first[("broken", "1")][0] == "UNAVAILABLE" and first[("broken", "1")][1]
    assert ("tokens", "2") not in first  # half written: not read yet
    assert unloaded.status_code == 200, unloaded.text
    assert gone.status_code == 404
    assert "model 'tiny' is not served (unloaded through the repository API)" in gone.text
    for actor in actors:  # killed at the unload
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.__ray_ready__.remote(), timeout=30)
    assert held[("tiny", "1")] == ("UNAVAILABLE", "unloaded through the repository API")
    assert last[("tokens", "2")] == ("READY", "")
    assert last[("tokens", "1")][0] == "UNAVAILABLE"  # latest n=1: the new one replaced it
    assert ready.status_code == 200
