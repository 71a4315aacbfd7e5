"""Where the settings come from and how their errors read: the TOML file source, the lists given
as text, and ``ConfigError``, whose message names each field, value and allowed range.

The TOML source is pydantic-settings' own (``TomlConfigSettingsSource``) with the house rules on
top: a ``[shardserve]`` table or top-level keys, dashes or underscores in names, and a file that
is named but missing, unreadable, not TOML or holding unknown settings refused with its path.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings, TomlConfigSettingsSource
from pydantic_settings.sources.types import Traversable


class ConfigError(ValueError):
    """Settings that cannot be used; the message names each field, value and allowed range."""


class TomlSource(TomlConfigSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], path: Path | None) -> None:
        if path is not None and not path.is_file():
            # pydantic-settings skips a file that is not there; one the user named is an error,
            # and reading it says why.
            _load(path)
        self._known = sorted(settings_cls.model_fields)  # read by _read_file, inside super()
        super().__init__(settings_cls, toml_file=path)

    def _read_file(self, file_path: Path | Traversable) -> dict[str, Any]:
        raw = _load(file_path)
        table = raw.get("shardserve", raw)
        values = {str(k).replace("-", "_"): v for k, v in table.items()}
        unknown = sorted(set(values) - set(self._known))
        if unknown:
            raise ConfigError(
                f"config file {str(file_path)!r} has unknown settings {unknown}; "
                f"known: {self._known}"
            )
        return values


def _load(path: Path | Traversable) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from exc


def split_csv(value: Any) -> Any:
    """A list given as text: a JSON array, or comma-separated items."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "settings"
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            lines.append(f"{field}: unknown setting")
        elif "input" in err and err["loc"]:
            lines.append(f"{field}: {msg} (got {err['input']!r})")
        else:
            lines.append(f"{field}: {msg}")
    return "invalid settings:\n  " + "\n  ".join(lines)
