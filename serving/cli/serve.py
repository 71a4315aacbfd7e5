"""``shardserve serve``: one flag per setting, generated from ``Settings`` so that the flags, the
env vars and the TOML keys can never drift apart; then the app under uvicorn, stopped within its
budget (``serving.server.graceful``)."""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

from serving.settings.config import ConfigError, Settings, load_settings
from serving.settings.flags import NEGATABLE, REPEATED, REPEATED_METAVARS, flag_name
from serving.settings.tls import uvicorn_tls
from serving.telemetry import setup as telemetry

err = Console(stderr=True)

_METAVARS = {int: "INT", float: "FLOAT", bool: "BOOL"}


def _metavar(annotation: Any) -> str:
    if "Literal['auto']" in str(annotation):
        return "MS|auto"
    for kind, name in _METAVARS.items():
        if kind is annotation or kind in getattr(annotation, "__args__", ()):
            return name
    return "TEXT"


def _setting_parameters() -> list[inspect.Parameter]:
    params = []
    for name, info in Settings.model_fields.items():
        default = info.get_default(call_default_factory=True)
        shown = "unset" if default in (None, [], {}) else str(default)
        help_text = f"{info.description} (env SHARDSERVE_{name.upper()}, default {shown})"
        if name in REPEATED:
            option = typer.Option(
                None,
                flag_name(name),
                help=help_text + ", repeatable",
                metavar=REPEATED_METAVARS[name],
            )
            annotation: Any = Optional[list[str]]  # noqa: UP045 - typer reads the annotation
        elif name in NEGATABLE:
            flag = flag_name(name)
            option = typer.Option(None, f"{flag}/--no-{flag[2:]}", help=help_text)
            annotation = Optional[bool]  # noqa: UP045
        else:
            option = typer.Option(
                None, flag_name(name), help=help_text, metavar=_metavar(info.annotation)
            )
            annotation = Optional[str]  # noqa: UP045
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation
            )
        )
    return params


def _with_setting_flags(func: Any) -> Any:
    sig = inspect.signature(func)
    fixed = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    func.__signature__ = sig.replace(parameters=[*fixed, *_setting_parameters()])
    return func


@_with_setting_flags
def serve(
    config: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--config", help="TOML file of settings (flags and env vars override it)."),
    ] = None,
    **flags: Any,
) -> None:
    """Serve a model over HTTP: POST /predict, batched and pipelined over Ray shard actors."""
    try:
        settings = load_settings(config, **flags)
        telemetry.check(settings)  # tracing on without its extra: one line, not a traceback
    except ConfigError as exc:
        # Escaped: a message's own brackets ('shardserve[tracing]') are not markup.
        err.print(f"[red]error:[/red] {escape(str(exc))}", markup=True, highlight=False)
        raise typer.Exit(2) from None
    if flags.get("admin_token") is not None:
        err.print(
            "[yellow]warning:[/yellow] --admin-token on the command line is visible to every "
            "user of this machine (ps, /proc/<pid>/cmdline) and kept in the shell's history; "
            "give --admin-token-file (a file of mode 600) or SHARDSERVE_ADMIN_TOKEN instead",
            markup=True,
            highlight=False,
        )
    run_server(settings)


# Read into the settings; the processes this one starts (Ray's, the stage actors running model
# code among them) inherit its environment, and the token has no business there.
_SECRET_ENV = ("SHARDSERVE_ADMIN_TOKEN",)


def run_server(settings: Settings) -> None:
    for name in _SECRET_ENV:
        os.environ.pop(name, None)
    # Read when grpc is first imported. Its fork handlers serve children that keep using gRPC;
    # this process forks only to exec (Ray starting its processes), and with the gRPC server up
    # the handlers bail out with a log line per fork.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    import uvicorn

    from serving.http.admin_token import is_loopback
    from serving.http.protocol import http_protocol
    from serving.server.app import create_app
    from serving.server.graceful import GracefulServer
    from shards.actor.tflog import set_tf_log_level

    # Before Ray starts: the workers it starts (shard actors, the resolve task) inherit it.
    set_tf_log_level(settings.log_level == "debug")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if (
        settings.admin_token is not None
        and not settings.tls
        and not settings.allow_plaintext_admin
        and not (settings.host == "localhost" or is_loopback(settings.host))
    ):
        logging.getLogger("shardserve").warning(
            "the admin routes take the admin token only from this machine: %s has no TLS "
            "(--tls-cert-file, --tls-key-file); behind a proxy that ends TLS, give "
            "--allow-plaintext-admin",
            settings.host,
        )
    server: GracefulServer | None = None

    def stop_serving(_: str) -> None:
        if server is not None:
            server.should_exit = True

    api = create_app(settings, on_load_failure=stop_serving)
    server = GracefulServer(
        uvicorn.Config(
            api,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=False,
            # The server never reads the client address; the proxy-headers layer costs CPU
            # on every request (py-spy, docs/benchmarks.md).
            proxy_headers=False,
            # Queue-full 503s answered from the request's headers, before any ASGI work;
            # hang-ups reported without a watcher task (serving/http/protocol.py).
            http=http_protocol(api),
            # The cap on open connections, for uvicorn's own protocol (no httptools); ours
            # applies the same rule itself. uvicorn counts the connection it refuses among the
            # open ones: N + 1 serves N.
            limit_concurrency=settings.max_connections + 1,
            # HTTPS (and mutual TLS) where a certificate is given.
            **uvicorn_tls(settings),
        ),
        state_of=lambda: getattr(api.state, "shardserve", None),
        stop_timeout_s=settings.stop_timeout_s,
    )
    server.run()
    state = getattr(api.state, "shardserve", None)
    # With --model a load failure ends the server (exit 1); a repository serves on without it.
    single = settings.model_repository is None
    served = state.served() if state and single else []
    failed = [m.reason for m in served if m.phase == "failed"]
    if failed:
        err.print(f"[red]error:[/red] the model failed to load: {escape(failed[0])}")
        raise typer.Exit(1)
