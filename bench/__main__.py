"""``python -m bench``: run the plan, write the JSON results, ``docs/benchmarks.md`` and plots.

Examples::

    python -m bench run                                      # the full comparison (long)
    python -m bench run --workloads light --systems shardserve-1,litserve --repeats 1 --seconds 2
    python -m bench report --results docs/bench_results.json # re-render from saved results
    python -m bench overload                                 # goodput at 3x capacity (hey)
    python -m bench chaos                                    # kill -9 and poison rows under load
    python -m bench protocols                                # TF-Serving JSON vs V2 JSON/binary/gRPC
    python -m bench memory                                   # memory plan vs actors' RSS
    python -m bench datapath                                 # bytes between shards, 16-bit
    python -m bench openloop                                 # auto vs fixed timeouts, Poisson
    python -m bench padding                                  # padded vs unpadded batches, CPU
    python -m bench looplag --compare-tree ../old            # 1-row p99 beside 16 MiB bodies
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import orjson

from bench.load.loops import WRK_INSTALL_HINT, have_wrk
from bench.suites import batching, chaos, datapath, looplag, memory, overload, protocols
from bench.suites.compare import Plan, run_plan
from bench.suites.compare_report import machine, plot, render


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in _csv(text))


def _rates(text: str) -> dict[str, float]:
    out = {}
    for part in _csv(text):
        name, sep, rate = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"open rate {part!r} must look like heavy=300")
        out[name] = float(rate)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure, then write the report")
    run.add_argument("--workloads", type=_csv, default=Plan.workloads)
    run.add_argument("--systems", type=_csv, default=Plan.systems)
    run.add_argument("--repeats", type=int, default=Plan.repeats)
    run.add_argument("--seconds", type=float, default=Plan.seconds)
    run.add_argument("--warmup", type=float, default=Plan.warmup_s)
    run.add_argument("--concurrency", type=_ints, default=Plan.concurrencies)
    run.add_argument("--open-rates", type=_rates, default=None, help="heavy=300,light=600")
    run.add_argument("--max-batch-size", type=int, default=Plan.max_batch_size)
    run.add_argument("--batch-timeout-ms", type=float, default=Plan.batch_timeout_ms)
    run.add_argument("--overlap-stages", type=_ints, default=Plan.overlap_stages)
    run.add_argument("--overlap-device-ms", type=float, default=Plan.overlap_device_ms)
    run.add_argument("--ceiling-seconds", type=float, default=Plan.ceiling_s)
    run.add_argument("--tool", choices=("auto", "wrk", "python"), default="auto")
    run.add_argument("--port", type=int, default=Plan.port)
    run.add_argument("--workdir", type=Path, default=Plan.workdir)
    run.add_argument("--out", type=Path, default=Path("docs"))
    report = sub.add_parser("report", help="re-render the report from saved results")
    report.add_argument("--results", type=Path, default=Path("docs/bench_results.json"))
    report.add_argument("--out", type=Path, default=Path("docs"))
    overload.add_parser(sub)
    chaos.add_parser(sub)
    protocols.add_parser(sub)
    memory.add_parser(sub)
    datapath.add_parser(sub)
    batching.add_parsers(sub)
    looplag.add_parser(sub)
    args = parser.parse_args(argv)
    command = "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:])

    if args.command in (
        "overload",
        "chaos",
        "protocols",
        "openloop",
        "padding",
        "memory",
        "datapath",
        "looplag",
    ):
        return _faults(args, command)

    if args.command == "report":
        results = orjson.loads(args.results.read_bytes())
        command = results.get("command", "python -m bench run")
    else:
        if args.tool == "wrk" and not have_wrk():
            parser.error(f"--tool wrk: wrk is not installed; {WRK_INSTALL_HINT}")
        if args.tool == "auto" and not have_wrk():
            print(f"note: wrk missing, using the Python generator; {WRK_INSTALL_HINT}")
        plan = Plan(
            workloads=args.workloads,
            systems=args.systems,
            repeats=args.repeats,
            seconds=args.seconds,
            warmup_s=args.warmup,
            concurrencies=args.concurrency,
            open_rates=args.open_rates if args.open_rates is not None else Plan().open_rates,
            max_batch_size=args.max_batch_size,
            batch_timeout_ms=args.batch_timeout_ms,
            overlap_stages=args.overlap_stages,
            overlap_device_ms=args.overlap_device_ms,
            ceiling_s=args.ceiling_seconds,
            tool=args.tool,
            port=args.port,
            workdir=args.workdir,
        )
        args.out.mkdir(parents=True, exist_ok=True)
        partial = args.out / "bench_results.partial.json"
        results = run_plan(
            plan,
            progress=lambda line: print(line, flush=True),
            checkpoint=lambda r: partial.write_bytes(orjson.dumps(r, option=orjson.OPT_INDENT_2)),
        )
        partial.unlink(missing_ok=True)
        results["command"] = command
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    doc = args.out / "benchmarks.md"
    old = doc.read_text() if doc.is_file() else ""
    doc.write_text(render(results, command, old))
    plot(results, args.out)
    print(f"wrote {doc}")
    return 0


def _faults(args: argparse.Namespace, command: str) -> int:
    """A bench of its own (issue 10's, issue 11's): print its table, keep its results and table
    under --out."""
    # Other processes on these cores skew every number: the load before and after is kept.
    load_before = os.getloadavg()
    results = args.handler(args)
    results["command"] = command
    results["machine"] = machine()
    results["loadavg"] = {"before": load_before, "after": os.getloadavg()}
    table = args.render(results)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.command}.json").write_bytes(
        orjson.dumps(results, option=orjson.OPT_INDENT_2)
    )
    loads = ", ".join(f"{k} {v[0]:.2f}" for k, v in results["loadavg"].items())
    header = f"`{command}`\n\n{machine()}; 1-min load average {loads}\n\n"
    (args.out / f"{args.command}.md").write_text(header + table)
    print(f"wrote {args.out / args.command}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
