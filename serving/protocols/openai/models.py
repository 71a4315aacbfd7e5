"""``GET /v1/models``: the models that generate, in OpenAI's shape (one entry per model name:
the ``model`` a completions body names). ``GET /v1/models/{name}`` is TF Serving's status route,
not OpenAI's model object (docs/generation.md says so).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

__all__ = ["ModelCard", "ModelList", "install_model_list", "model_list"]

_STARTED = int(time.time())


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    model_config = ConfigDict(extra="forbid")
    object: Literal["list"]
    data: list[ModelCard]


def model_list(served: list[Any]) -> dict[str, Any]:
    """The list of the served versions' names (``ServedModel``s) that hold a generator."""
    names = sorted({m.name for m in served if getattr(m, "generator", None) is not None})
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": _STARTED, "owned_by": "shardserve"}
            for name in names
        ],
    }


async def _models(request: Request) -> dict[str, Any]:
    return model_list(request.app.state.shardserve.served())


def install_model_list(app: FastAPI) -> None:
    app.add_api_route(
        "/v1/models",
        _models,
        methods=["GET"],
        response_model=ModelList,
        tags=["openai"],
        summary="The models that generate text (OpenAI's model list)",
    )
