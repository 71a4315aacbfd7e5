"""The ``shardserve`` command: ``serve`` (serving.cli.serve), ``partition`` and ``plan``
(serving.cli.partition), ``tune`` (serving.cli.tune, from loadtest) and ``cache``
(serving.cli.cache)."""

from __future__ import annotations

import typer

from serving.cli.cache import app as cache_app
from serving.cli.partition import partition, plan
from serving.cli.serve import serve
from serving.cli.tune import tune

app = typer.Typer(
    name="shardserve",
    help="Batched inference serving for Keras models sharded over Ray actors.",
    no_args_is_help=True,
    add_completion=False,
)
app.command("serve")(serve)
app.add_typer(cache_app)
app.command("partition")(partition)
app.command("plan")(plan)
app.command("tune")(tune)


def main() -> None:  # pragma: no cover - console entry for `python -m serving.cli.main`
    app(prog_name="shardserve")


if __name__ == "__main__":  # pragma: no cover
    main()
