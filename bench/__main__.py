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
    python -m bench frontcpu --compare-tree ../old           # front-end CPU/req, new vs old
    python -m bench ragged                                   # mixed lengths, length padded
    python -m bench rollout --quick                          # version switch, canary rollback
    python -m bench elastic --quick                          # replicas follow a load step
    python -m bench split                                    # split layers against one stage
    python -m bench soak                                     # front-end RSS, 10 min of load
    python -m bench generate --blocks 2 --hidden 64 --rounds 1 --duration 5   # generation, quick
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import orjson

from bench.observe.machine import machine
from bench.suites import (
    batching,
    chaos,
    compare,
    datapath,
    elastic,
    frontcpu,
    generate,
    looplag,
    memory,
    overload,
    protocols,
    ragged,
    rollout,
    soak,
    split,
)

# In the order of ``--help``.
SUITES = (
    compare,
    overload,
    chaos,
    protocols,
    memory,
    datapath,
    batching,
    looplag,
    frontcpu,
    ragged,
    rollout,
    elastic,
    split,
    soak,
    generate,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for suite in SUITES:
        suite.add_parsers(sub)
    args = parser.parse_args(argv)
    command = "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:])
    if "write" in args:  # run and report write the comparison's report their own way
        return int(args.write(args, command))
    return _write(args, command)


def _write(args: argparse.Namespace, command: str) -> int:
    """A suite's run: print its table, keep its results and table under ``--out``."""
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
