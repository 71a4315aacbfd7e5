"""The model repository's server-wide settings: ``--model-repository``, ``--default-model`` and
``--repository-poll-s``. A base of ``serving.settings.config.Settings`` (same flags, env
vars and TOML keys as every other setting).

A server serves either one model (``--model``) or a repository (``--model-repository``): giving
both is an error, since it is not clear which one ``/predict`` would serve.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field, field_validator, model_validator

__all__ = ["MODEL_NAME_PATTERN", "RepositorySettings"]

# A model's name: its directory in the repository and its URL segment (/v2/models/{name}).
MODEL_NAME_PATTERN = r"[A-Za-z0-9_.-]+"
_MODEL_NAME = re.compile(MODEL_NAME_PATTERN)


class RepositorySettings(BaseModel):
    model_repository: Path | None = Field(
        None,
        description="Serve every model of this directory: DIR/<name>/<version>/ holding a .keras "
        "file, a SavedModel or a bundle, DIR/<name>/config.toml its settings; instead of --model.",
    )
    default_model: str | None = Field(
        None,
        description="The repository's model that /predict (and /admin/batching) serve; unset = "
        "the only model (with several, /predict answers 400 listing them).",
    )
    repository_poll_s: float = Field(
        0.0,
        ge=0,
        le=86_400,
        description="Look for versions added to or removed from --model-repository this often "
        "(seconds); 0 = read it once at start.",
    )

    if TYPE_CHECKING:  # fields and methods of Settings, which this is a base of
        model: str

        def served_name(self) -> str: ...

    @field_validator("model_repository", mode="after")
    @classmethod
    def _existing_dir(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        path = value.expanduser()
        if not path.is_dir():
            raise ValueError(
                f"no directory at {str(path)!r}; give the repository's directory "
                "(DIR/<name>/<version>/)"
            )
        return path

    @field_validator("default_model", mode="after")
    @classmethod
    def _model_name(cls, value: str | None) -> str | None:
        if value is not None and (value.startswith(".") or not _MODEL_NAME.fullmatch(value)):
            raise ValueError(
                f"{value!r} is not a model name: a repository directory name of letters, "
                "digits, '_', '.' and '-', not starting with '.'"
            )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> RepositorySettings:
        if self.model_repository is None:
            if self.repository_poll_s:
                raise ValueError(
                    f"repository_poll_s ({self.repository_poll_s:g}) polls a model repository; "
                    "give --model-repository too, or leave it 0"
                )
            if self.default_model is not None and self.default_model != self.served_name():
                raise ValueError(
                    f"default_model {self.default_model!r} names a model of --model-repository; "
                    f"with --model the one model ({self.served_name()!r}) is the default"
                )
            return self
        if "model" in self.model_fields_set:
            raise ValueError(
                f"give either model ({self.model!r}) or model_repository "
                f"({str(self.model_repository)!r}), not both: a repository names its models "
                "by their directories"
            )
        return self
