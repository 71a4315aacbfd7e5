"""A model's own settings: ``<repository>/<name>/config.toml``.

Its keys are the server's own settings (``stages``, ``replicas``, ``max_batch_size``, ...), each
defaulting to the server-wide value, plus the tables below (and ``[traffic]`` / ``[canary]``, a
canary's share and rules: ``serving.canary.config``)::

    max_batch_size = 16
    [versions]
    policy = "latest"    # "latest" (with n), "all", or "specific" (with versions = [1, 3])
    n = 2
    [labels]
    stable = 3           # /v1/models/<name>/labels/stable -> version 3

A key that is not a setting is an error naming the file, the key and what is allowed; a setting
that only makes sense once per server (the ports, the admin token, the Ray address, ...) is an
error that says why. Values are checked when a version's settings are built (``model_settings``)
because cross-field rules (``max_queue_rows >= max_batch_size``) need the server's values.

Errors name the file relative to the repository (``resnet/config.toml``): the repository index
shows them to clients, and those never see the server's paths.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from serving.canary.config import TrafficConfig, read_traffic
from serving.repository.version_policy import VersionPolicy
from serving.settings.config import ConfigError, Settings
from serving.settings.repository import MODEL_NAME_PATTERN, RepositorySettings
from serving.settings.tls import TlsSettings

if TYPE_CHECKING:
    from serving.repository.layout import VersionDir

__all__ = [
    "CONFIG_FILE",
    "SERVER_WIDE",
    "ModelConfig",
    "model_keys",
    "model_settings",
    "read_model_config",
]

CONFIG_FILE = "config.toml"
_REPOSITORY = "a setting of the whole repository, not of one model"
# Settings a model's config.toml may not hold, and why (the error says it).
SERVER_WIDE: dict[str, str] = {
    "host": "one HTTP server serves every model",
    "port": "one HTTP server serves every model",
    "grpc_port": "one gRPC server serves every model",
    "max_body_bytes": "the gRPC server's message limit is one for every model",
    "admin_token": "one admin token guards the server's admin routes",
    "admin_token_file": "one admin token guards the server's admin routes",
    "log_level": "the server has one log",
    "stop_timeout_s": "a stop (SIGTERM) ends the whole server within one budget",
    "model": "the version directory is the model (<name>/<version>/)",
    "model_name": "the model's directory names it",
    "ray_address": "the server joins one Ray cluster",
    "imports": "the modules are shipped to the Ray cluster once, when the server joins it",
    "unsafe_deserialization": "letting a model file run Python code is the operator's choice, "
    "made for the server",
    "cache_dir": "the server keeps one bundle cache",
    "cache_max_bytes": "the server keeps one bundle cache",
    "grpc_max_streams": "the gRPC server's limits are one for every model",
    "grpc_max_open_calls": "the gRPC server's limits are one for every model",
    "grpc_max_connection_idle_s": "the gRPC server's limits are one for every model",
    "grpc_max_connection_age_s": "the gRPC server's limits are one for every model",
    **{key: "one TLS identity serves every model" for key in TlsSettings.model_fields},
    "allow_plaintext_admin": "one admin token guards the server's admin routes",
    **{key: _REPOSITORY for key in RepositorySettings.model_fields},
}
_TABLES = ("versions", "labels", "traffic", "canary")
_EXCLUSIVE = (
    ("stages", "max_stage_bytes"),
    ("max_stage_bytes", "stages"),
    # A fixed count (replicas) or bounds (min/max_replicas): the model's way replaces the server's.
    *(("replicas", bound) for bound in ("min_replicas", "max_replicas")),
    *((bound, "replicas") for bound in ("min_replicas", "max_replicas")),
)
_POLICY_KEYS = ("policy", "n", "versions")
_LABEL = re.compile(MODEL_NAME_PATTERN)


@dataclass(frozen=True)
class ModelConfig:
    overrides: dict[str, Any] = field(default_factory=dict)
    policy: VersionPolicy = field(default_factory=VersionPolicy)
    labels: dict[str, int] = field(default_factory=dict)
    traffic: TrafficConfig | None = None  # [traffic] and [canary]: serving.canary.config


def model_keys() -> list[str]:
    """The settings a model's config.toml may set, sorted."""
    return sorted(k for k in Settings.model_fields if k not in SERVER_WIDE)


def read_model_config(model_dir: Path) -> ModelConfig:
    """``model_dir / config.toml``, checked key by key; no file: the defaults."""
    path = model_dir / CONFIG_FILE
    where = f"{model_dir.name}/{CONFIG_FILE}"
    if not path.exists():
        return ModelConfig()
    raw = _load(path, where)
    overrides: dict[str, Any] = {}
    tables: dict[str, Any] = {}
    refused: list[str] = []
    unknown: list[str] = []
    allowed = set(model_keys())
    for given, value in raw.items():
        key = given.replace("-", "_")
        if key in _TABLES:
            tables[key] = value
        elif key in SERVER_WIDE:
            refused.append(f"{given!r} is server-wide ({SERVER_WIDE[key]})")
        elif key in allowed:
            overrides[key] = value
        else:
            unknown.append(given)
    if unknown:
        names = ", ".join(map(repr, unknown))
        near = [m for k in unknown for m in difflib.get_close_matches(k, sorted(allowed), 1)]
        hint = f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
        raise ConfigError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {names}{hint}; allowed: the "
            f"tables [versions], [labels], [traffic] and [canary] and the settings {model_keys()}"
        )
    if refused:
        raise ConfigError(
            f"{where}: {'; '.join(refused)}; set it for the server (flag, env var or --config), "
            "not per model"
        )
    return ModelConfig(
        overrides=overrides,
        policy=_policy(tables.get("versions", {}), where),
        labels=_labels(tables.get("labels", {}), where),
        traffic=read_traffic(tables, where),
    )


def model_settings(
    base: Settings, name: str, version_dir: VersionDir, config: ModelConfig
) -> Settings:
    """The settings one version is served with: the server's, the model's overrides on top,
    ``model`` = the version's model file or directory, ``model_name`` = ``name``. Every failure
    is a one-line ``ConfigError``."""
    # Every field given: the env vars (and a TOML file) are read by Settings() for each field
    # left out, and they may have changed since the server started.
    values: dict[str, Any] = {key: getattr(base, key) for key in Settings.model_fields}
    # One version is one model: no repository of its own (given, or an env var would fill it).
    values.update(model_repository=None, default_model=None, repository_poll_s=0.0)
    # A model that sets how it is cut (or its replicas) replaces the server's way of the two.
    for given, other in _EXCLUSIVE:
        if given in config.overrides and other not in config.overrides:
            values.pop(other, None)
    values.update(config.overrides)
    try:
        values["model"] = str(version_dir.model_path)
    except FileNotFoundError as exc:  # changed since the scan: one error type for the caller
        raise ConfigError(str(exc)) from None
    values["model_name"] = name
    try:
        return Settings(**values)
    except ValidationError as exc:
        raise ConfigError(f"{name}/{CONFIG_FILE}: {_one_line(exc)}") from None


def _load(path: Path, where: str) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where} is not valid TOML: {exc}") from None


def _policy(table: Any, where: str) -> VersionPolicy:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: versions must be a table ([versions]), got {table!r}")
    values = {str(k).replace("-", "_"): v for k, v in table.items()}
    unknown = sorted(set(values) - set(_POLICY_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown} in [versions]; allowed: {list(_POLICY_KEYS)}"
        )
    policy = values.get("policy", "latest")
    if "n" in values and policy != "latest":
        raise ConfigError(f'{where}: [versions] n is only read with policy = "latest"')
    versions = values.get("versions", [])
    if not isinstance(versions, list):
        raise ConfigError(f"{where}: [versions] versions must be a list of versions, e.g. [1, 3]")
    try:
        return VersionPolicy(policy=policy, n=values.get("n", 1), versions=tuple(versions))
    except ValueError as exc:
        raise ConfigError(f"{where}: [versions] {exc}") from None


def _labels(table: Any, where: str) -> dict[str, int]:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: labels must be a table ([labels]), got {table!r}")
    labels: dict[str, int] = {}
    for label, version in table.items():
        if not _LABEL.fullmatch(label):
            raise ConfigError(
                f"{where}: label {label!r} must be letters, digits, '_', '.' and '-' (it is a "
                "URL segment: /v1/models/<name>/labels/<label>)"
            )
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ConfigError(
                f"{where}: [labels] {label} must be a version number (a positive integer), "
                f"got {version!r}"
            )
        labels[label] = version
    return labels


def _one_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "settings"
        msg = str(err["msg"]).removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if err["loc"] and "input" in err else ""
        parts.append(f"{key}: {msg}{got}")
    return "; ".join(parts)
