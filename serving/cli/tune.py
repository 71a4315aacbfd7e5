"""``shardserve tune``: the batching sweep of ``loadtest.tune``, or with ``--generate`` a generating
model's knobs sweep (``loadtest.gentune``), imported only when the command runs (it needs the
loadtest extra: Locust and matplotlib)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

err = Console(stderr=True)


def tune(
    url: Annotated[str, typer.Option("--url", help="Base URL of a running shardserve server.")],
    out: Annotated[Path, typer.Option("--out", help="Directory for the results and report.")],
    timeouts: Annotated[
        str, typer.Option(help="batch_timeout_ms values to try, comma-separated; 'auto' too.")
    ] = "0,1,2,5,10,20,auto",
    loads: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            help="Load levels: user counts (closed loop) or rates like 200rps. "
            "Default 4,16,64; with --generate, 8 streaming users."
        ),
    ] = None,
    duration: Annotated[float, typer.Option(help="Seconds measured per point.", min=1)] = 20.0,
    warmup: Annotated[
        float, typer.Option(help="Seconds of warm-up per point, not measured.", min=0)
    ] = 3.0,
    slo_p99_ms: Annotated[
        Optional[float],  # noqa: UP045
        typer.Option("--slo-p99-ms", help="p99 target; the winner is the fastest under it."),
    ] = None,
    max_batch_sizes: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--max-batch-sizes", help="Also sweep these max_batch_size values."),
    ] = None,
    rows: Annotated[int, typer.Option(help="Rows per request.", min=1)] = 1,
    repeats: Annotated[
        int, typer.Option(help="Runs per point, interleaved; the report gives medians.", min=1)
    ] = 1,
    model_name: Annotated[str, typer.Option(help="Served model name; default: asked.")] = "",
    protocol: Annotated[
        str,
        typer.Option(
            help="Request format: tfserving (/predict JSON), v2-json or v2-binary (/v2 infer)."
        ),
    ] = "tfserving",
    admin_token: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(envvar="SHARDSERVE_ADMIN_TOKEN", help="The server's admin token."),
    ] = None,
    generate: Annotated[
        bool,
        typer.Option(
            "--generate",
            help="Tune a generating model: prefill_timeout_ms x max_running_sequences x "
            "prefill_budget_tokens, with the streaming user.",
        ),
    ] = False,
    prefill_timeouts: Annotated[
        str, typer.Option(help="--generate: prefill_timeout_ms values; 'auto' too.")
    ] = "auto,20",
    max_running: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="--generate: max_running_sequences values; default kv_slots, half."),
    ] = None,
    prefill_budgets: Annotated[
        str, typer.Option(help="--generate: prefill_budget_tokens values; 'none': no cap.")
    ] = "none,64",
    workload: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="--generate: a TOML/JSON file of prompts and max_tokens to draw."),
    ] = None,
    prompt_tokens: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="--generate: prompt lengths MIN:MAX of random ids (over --workload)."),
    ] = None,
    max_tokens: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="--generate: max_tokens MIN:MAX (over --workload)."),
    ] = None,
    ttft_p95_ms: Annotated[
        Optional[float],  # noqa: UP045
        typer.Option("--ttft-p95-ms", help="--generate: the TTFT p95 target."),
    ] = None,
    tpot_p95_ms: Annotated[
        Optional[float],  # noqa: UP045
        typer.Option("--tpot-p95-ms", help="--generate: the time-per-output-token p95 target."),
    ] = None,
) -> None:
    """Sweep batch_timeout_ms (x load x batch size) with Locust, or with --generate a generating
    model's prefill timeout x running limit x prefill budget against TTFT and TPOT p95 targets;
    write a report, a plot and a config."""
    missing = [m for m in ("locust", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        err.print(
            f"[red]error:[/red] shardserve tune needs {' and '.join(missing)}: "
            "pip install 'shardserve\\[loadtest]'",  # \[ : not a rich markup tag
            highlight=False,
        )
        raise typer.Exit(2)
    from loadtest.tune import TuneConfig, parse_loads, parse_protocol, parse_sizes, parse_timeouts
    from loadtest.tune import tune as run_tune

    if generate:
        from loadtest.gentune import tune_generation

        try:
            code = tune_generation(
                url=url,
                out=out,
                model_name=model_name,
                loads=loads or "8",
                timeouts=prefill_timeouts,
                running=max_running,
                budgets=prefill_budgets,
                workload=workload,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                duration_s=duration,
                warmup_s=warmup,
                ttft_p95_ms=ttft_p95_ms,
                tpot_p95_ms=tpot_p95_ms,
                repeats=repeats,
                admin_token=admin_token,
            )
        except (ValueError, RuntimeError) as exc:
            err.print(f"[red]error:[/red] {exc}", highlight=False)
            raise typer.Exit(2 if isinstance(exc, ValueError) else 1) from None
        raise typer.Exit(code)
    try:
        config = TuneConfig(
            url=url,
            timeouts=parse_timeouts(timeouts),
            loads=parse_loads(loads or "4,16,64"),
            duration_s=duration,
            out=out,
            slo_p99_ms=slo_p99_ms,
            max_batch_sizes=parse_sizes(max_batch_sizes),
            warmup_s=warmup,
            rows=rows,
            admin_token=admin_token,
            model_name=model_name,
            repeats=repeats,
            protocol=parse_protocol(protocol),
        )
        code = run_tune(config)
    except (ValueError, RuntimeError) as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2 if isinstance(exc, ValueError) else 1) from None
    raise typer.Exit(code)
