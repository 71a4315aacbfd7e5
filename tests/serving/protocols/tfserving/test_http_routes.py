"""TF Serving's routes over a repository of several models and versions: a request reaches the
version its path names (by number, by label, or the model's highest), status lists every
version, and an unknown model, version or label is a 404 naming what is served."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serving.served_app import row
from tests.serving.served_repository import Runners, serve_repository, write_repository

A_CONFIG = '[versions]\npolicy = "all"\n[labels]\nstable = 1\n'
BODY = {"instances": [row(1)]}


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    return write_repository(tmp_path / "repo", {"a": ([1, 2], A_CONFIG), "b": ([1], "")})


async def test_each_predict_path_reaches_the_version_it_names(repository: Path) -> None:
    runners = Runners()
    async with serve_repository(repository, runners) as client:
        for path, reached in (
            ("/v1/models/a:predict", ("a", "2")),  # the highest ready version
            ("/v1/models/a/versions/1:predict", ("a", "1")),
            ("/v1/models/a/labels/stable:predict", ("a", "1")),
            ("/v1/models/b:predict", ("b", "1")),
            ("/v2/models/a/versions/1/infer", ("a", "1")),
            ("/v2/models/a/infer", ("a", "2")),
        ):
            before = runners.calls()
            if path.startswith("/v2"):
                body = {
                    "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": row(1)}]
                }
                r = await client.post(path, json=body)
            else:
                r = await client.post(path, json=BODY)
            assert r.status_code == 200, (path, r.text)
            after = runners.calls()
            changed = [key for key in after if after[key] != before.get(key)]
            assert changed == [reached], path


async def test_unknown_models_versions_and_labels_are_404s_naming_what_is_served(
    repository: Path,
) -> None:
    async with serve_repository(repository, Runners()) as client:
        answers = {
            path: await client.post(path, json=BODY)
            for path in (
                "/v1/models/c:predict",
                "/v1/models/a/versions/7:predict",
                "/v1/models/a/labels/canary:predict",
                "/v1/models/b/labels/stable:predict",
            )
        }
        status = await client.get("/v1/models/a/versions/7")
        metadata = await client.get("/v1/models/a/labels/canary/metadata")
        v2 = await client.get("/v2/models/a/versions/7/ready")
        default = await client.post("/predict", json=BODY)
    messages = {path: (r.status_code, r.json()["error"]) for path, r in answers.items()}
    assert messages == {
        "/v1/models/c:predict": (404, "model 'c' not found; this server serves 'a', 'b'"),
        "/v1/models/a/versions/7:predict": (
            404,
            "model 'a' has no version '7'; its versions: ['1', '2']",
        ),
        "/v1/models/a/labels/canary:predict": (
            404,
            "model 'a' has no label 'canary'; its labels: ['stable']",
        ),
        "/v1/models/b/labels/stable:predict": (
            404,
            "model 'b' has no label 'stable'; it has no label set",
        ),
    }
    assert (status.status_code, metadata.status_code, v2.status_code) == (404, 404, 404)
    assert "its versions: ['1', '2']" in status.json()["error"]
    # Two models and no --default-model: /predict cannot choose.
    assert default.status_code == 400 and "'a', 'b'" in default.json()["error"]


async def test_status_lists_every_version_and_metadata_names_the_one_served(
    repository: Path,
) -> None:
    async with serve_repository(repository, Runners(), default_model="b") as client:
        every = (await client.get("/v1/models/a")).json()
        one = (await client.get("/v1/models/a/versions/1")).json()
        labelled = (await client.get("/v1/models/a/labels/stable")).json()
        latest = (await client.get("/v1/models/a/metadata")).json()
        first = (await client.get("/v1/models/a/versions/1/metadata")).json()
        by_label = (await client.get("/v1/models/a/labels/stable/metadata")).json()
        v2 = (await client.get("/v2/models/a")).json()
        v2_first = (await client.get("/v2/models/a/versions/1")).json()
        default = await client.post("/predict", json=BODY)
    assert [(v["version"], v["state"]) for v in every["model_version_status"]] == [
        ("1", "AVAILABLE"),
        ("2", "AVAILABLE"),
    ]
    assert every["model_version_status"][0]["replicas"] == {"total": 1, "healthy": 1}
    assert [v["version"] for v in one["model_version_status"]] == ["1"]
    assert [v["version"] for v in labelled["model_version_status"]] == ["1"]
    assert latest["model_spec"] == {"name": "a", "version": "2"}
    assert first["model_spec"] == by_label["model_spec"] == {"name": "a", "version": "1"}
    assert default.status_code == 200  # --default-model b
    assert v2["versions"] == v2_first["versions"] == ["1", "2"]  # V2: every version served
