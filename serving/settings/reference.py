"""The settings reference, ``docs/settings.md``, written from ``Settings`` itself so that it cannot
go stale: ``python -m serving.settings.reference`` writes it, ``--check`` says whether it is current
(``tests/serving/test_readme.py`` fails when it is not)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

from serving.settings.config import Settings
from serving.settings.flags import flags

__all__ = ["PATH", "main", "render"]

PATH = Path(__file__).resolve().parents[2] / "docs" / "settings.md"

_HEAD = """\
# Settings

<!-- Written by `python -m serving.settings.reference` from serving/settings/ (the fields'
descriptions and defaults): edit those, then run it again. A test fails when this file differs. -->

Every knob of the server is one field of one typed settings object (`serving/settings/config.py`).
Strongest first: a flag (`--max-batch-size 64`), an environment variable
(`SHARDSERVE_MAX_BATCH_SIZE=64`), a TOML file (`--config shardserve.toml`, keys as below), the
default. Invalid values are refused at start with the field, the value and the range. A model of
a repository takes the same keys in its own `config.toml`
([docs/repository.md](repository.md#configtoml)). `shardserve serve --help` prints the same list.

Sizes in bytes take units (`16GiB`, `600KB`); lists take commas (`16,32,64`) or repeat the flag.
Where each topic is explained: [HTTP and gRPC API](api.md), [models, budgets and split
layers](models.md), [the model repository and what is trusted](repository.md), [generating
text](generation.md), [observability](observability.md), [deploying, TLS, elastic
replicas](deploy.md), [tuning the batcher](tuning.md).
"""
_TABLE = "| setting | default | env var | flag | what it does |\n|---|---|---|---|---|\n"

# A section per module of serving/settings/ that defines fields, with the page that explains them;
# a module not named here gets a section under its own name.
_SECTIONS = {
    "serving.settings.config": ("The server, the model, placement and batching", ""),
    "serving.settings.grpc_limits": ("gRPC limits", "api.md#grpc"),
    "serving.settings.tls": ("TLS", "deploy.md#tls"),
    "serving.settings.repository": ("Model repository", "repository.md"),
    "serving.settings.elastic": ("Elastic replicas", "deploy.md#elastic-replicas"),
    "serving.settings.lengths": ("Variable-length inputs", "models.md#variable-length-inputs"),
    "serving.settings.generation": ("Generating text", "generation.md"),
}


def _default(name: str, value: Any) -> str:
    if value is None or value == [] or value == {}:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        home = str(Path.home())
        text = str(value)
        return "~" + text[len(home) :] if text.startswith(home + "/") else text
    if name.endswith("_bytes") and isinstance(value, int) and value >= 1024:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"{value} ({value // size} {unit})"
    return str(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _owner(name: str) -> str:
    """The module of the class in ``Settings``' bases that declares the field ``name``."""
    for cls in Settings.__mro__:
        if name in inspect.get_annotations(cls):
            return cls.__module__
    return Settings.__module__


def render() -> str:
    """The whole of ``docs/settings.md``: a section per settings module, a row per field."""
    sections: dict[str, list[str]] = {module: [] for module in _SECTIONS}
    for name, info in Settings.model_fields.items():
        default = _default(name, info.get_default(call_default_factory=True))
        flag = ", ".join(f"`{f}`" for f in flags(name))
        what = _cell(info.description or "")
        row = f"| `{name}` | `{_cell(default)}` | `SHARDSERVE_{name.upper()}` | {flag} | {what} |\n"
        sections.setdefault(_owner(name), []).append(row)
    parts = [_HEAD]
    for module, rows in sections.items():
        if not rows:
            continue
        title, page = _SECTIONS.get(module, (module.rsplit(".", 1)[-1], ""))
        source = module.replace(".", "/") + ".py"
        where = f" Explained in [{page.split('#')[0]}]({page})." if page else ""
        parts.append(f"\n## {title}\n\nDeclared in `{source}`.{where}\n\n{_TABLE}{''.join(rows)}")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if args == ["--check"]:
        current = PATH.read_text(encoding="utf-8") if PATH.exists() else ""
        if current != text:
            print(f"{PATH} is stale: run python -m serving.settings.reference", file=sys.stderr)
            return 1
        return 0
    if args:
        print("usage: python -m serving.settings.reference [--check]", file=sys.stderr)
        return 2
    PATH.write_text(text, encoding="utf-8")
    print(f"wrote {PATH} ({len(Settings.model_fields)} settings)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
