"""``shardserve cache list|prune``: what the bundle cache holds, and emptying it to a size.

The cache directory and its bound come from the same settings as ``serve`` (``--cache-dir``,
``SHARDSERVE_CACHE_DIR``, the TOML file), so these commands look where the server writes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from serving.settings.config import ConfigError, Settings, load_settings
from shards.bundle import cache
from shards.partition.memory_plan import format_size, parse_bytes

app = typer.Typer(
    name="cache",
    help="The bundle cache: partitioned models kept for the next start.",
    no_args_is_help=True,
)
err = Console(stderr=True)

ConfigOption = Annotated[
    Optional[Path],  # noqa: UP045 - typer reads the annotation
    typer.Option("--config", help="TOML file of settings, as for serve."),
]
CacheDirOption = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Option(
        "--cache-dir", help="The cache directory; default: the setting (env SHARDSERVE_CACHE_DIR)."
    ),
]


def _settings(config: Path | None, cache_dir: Path | None) -> Settings:
    try:
        return load_settings(config, cache_dir=cache_dir)
    except ConfigError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None


def _stdout() -> Console:
    out = Console()
    # Piped or captured, rich assumes 80 columns and would cut the table's cells.
    return out if out.is_terminal else Console(width=200)


def _ago(when: float) -> str:
    seconds = max(0.0, time.time() - when)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return "just now"


def _table(title: str, entries: list[cache.Entry], *, in_use: bool) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("key", "model", "size", "last used"):
        table.add_column(column, justify="right" if column == "size" else "left")
    if in_use:
        table.add_column("in use")
    for e in reversed(entries):  # most recently used first
        model = e.source if e.current else f"{e.source} (format {e.format_version or '?'}: stale)"
        row = [e.key, model, format_size(e.size_bytes), _ago(e.last_used)]
        table.add_row(*row, *(["yes" if e.in_use else "no"] if in_use else []))
    return table


@app.command("list")
def list_(config: ConfigOption = None, cache_dir: CacheDirOption = None) -> None:
    """The cached bundles, most recently used first: key, model, size, last use, in use."""
    settings = _settings(config, cache_dir)
    entries = cache.entries(settings.cache_dir)
    total = sum(e.size_bytes for e in entries)
    _stdout().print(_table(str(settings.cache_dir), entries, in_use=True))
    err.print(
        f"{len(entries)} bundle(s), {format_size(total)} of cache_max_bytes "
        f"{format_size(settings.cache_max_bytes)}",
        highlight=False,
    )


@app.command("prune")
def prune(
    config: ConfigOption = None,
    cache_dir: CacheDirOption = None,
    max_bytes: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--max-bytes",
            help="Prune to this size, e.g. 5GiB; default: the cache_max_bytes setting.",
            metavar="BYTES",
        ),
    ] = None,
    all_: Annotated[
        bool, typer.Option("--all", help="Remove every bundle not being served.")
    ] = False,
) -> None:
    """Remove bundles until the cache fits: least recently used first, never one served.

    Bundles of another format version go before any current one."""
    settings = _settings(config, cache_dir)
    if all_ and max_bytes is not None:
        err.print("[red]error:[/red] give --max-bytes or --all, not both")
        raise typer.Exit(2)
    limit = settings.cache_max_bytes
    if all_:
        limit = 0
    elif max_bytes is not None:
        try:
            limit = 0 if max_bytes.strip() == "0" else parse_bytes(max_bytes)
        except ValueError as exc:
            err.print(f"[red]error:[/red] --max-bytes: {exc}", highlight=False)
            raise typer.Exit(2) from None
    removed = cache.prune(settings.cache_dir, limit)
    left = cache.entries(settings.cache_dir)
    if removed:
        title = f"removed from {settings.cache_dir}"
        _stdout().print(_table(title, removed, in_use=False))
    served = sum(1 for e in left if e.in_use)
    err.print(
        f"removed {len(removed)} bundle(s), {format_size(sum(e.size_bytes for e in removed))}; "
        f"left {len(left)} ({format_size(sum(e.size_bytes for e in left))}, {served} in use), "
        f"limit {format_size(limit)}",
        highlight=False,
    )
