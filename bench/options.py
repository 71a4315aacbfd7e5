"""The command-line options the benches share, declared once, and the plans they fill.

A suite's options are named after the fields of its plan dataclass (``--warmup`` fills
``warmup_s``), so ``plan_from(OverloadPlan, args)`` builds the plan, and each option's default is
read from the plan itself: a default is written in one place, the plan.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

Plan = TypeVar("Plan")
Results = dict[str, Any]
Progress = Callable[[str], None]


def csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in csv(text))


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in csv(text))


# name -> (flag, what argparse is given); the name is the plan field the option fills.
COMMON: dict[str, tuple[str, dict[str, Any]]] = {
    "workload": ("--workload", {"help": "heavy, light or conv"}),
    "workloads": ("--workloads", {"type": csv, "help": "comma-separated: heavy,light"}),
    "model": ("--model", {}),
    "models": ("--models", {"type": csv, "help": "comma-separated"}),
    "stages": ("--stages", {"type": int}),
    "max_batch_size": ("--max-batch-size", {"type": int}),
    "batch_timeout_ms": ("--batch-timeout-ms", {"type": float}),
    "simulate_device_ms": ("--simulate-device-ms", {"type": float}),
    "url": ("--url", {}),
    "concurrency": ("--concurrency", {"type": int, "help": "closed-loop clients"}),
    "clients": ("--clients", {"type": int}),
    "capacity_clients": ("--capacity-clients", {"type": int}),
    "capacity_s": ("--capacity-seconds", {"type": float}),
    "seconds": ("--seconds", {"type": float, "help": "of load per measurement"}),
    "warmup_s": ("--warmup", {"type": float, "help": "seconds of uncounted load first"}),
    "ceiling_s": ("--ceiling-seconds", {"type": float}),
    "repeats": ("--repeats", {"type": int, "help": "rounds, the order rotated in each"}),
    "seed": ("--seed", {"type": int}),
    "pin": ("--pin", {"action": argparse.BooleanOptionalAction}),
    "port": ("--port", {"type": int, "help": "the server's port; 0: a free one"}),
    "workdir": ("--workdir", {"type": Path, "help": "models, caches and server logs"}),
    "out": ("--out", {"type": Path, "help": "where the results go (JSON and Markdown)"}),
}


class Options:
    """Declares the options of one parser; each defaults to the field it fills in ``defaults``
    (the suite's plan), when there is one."""

    def __init__(self, parser: argparse.ArgumentParser, defaults: object | None = None) -> None:
        self.parser = parser
        self.defaults = defaults

    def add(self, *names: str, **changes: Any) -> None:
        """The common options ``names``; ``changes`` (``dest=``, ``help=``, ``required=``,
        ``default=``...) apply to each of them."""
        for name in names:
            flag, declared = COMMON[name]
            self.own(flag, **{"dest": name, **declared, **changes})

    def own(self, flag: str, **kwargs: Any) -> None:
        """An option of this parser's own: it fills the field named after it
        (``--poison-fraction``: ``poison_fraction``) unless ``dest=`` names another."""
        kwargs.setdefault("dest", flag.removeprefix("--").replace("-", "_"))
        if "action" not in kwargs and "choices" not in kwargs:  # in --help: the flag's name
            kwargs.setdefault("metavar", flag.removeprefix("--").upper().replace("-", "_"))
        if self.defaults is not None and "default" not in kwargs and not kwargs.get("required"):
            kwargs["default"] = getattr(self.defaults, kwargs["dest"])
        self.parser.add_argument(flag, **kwargs)


def suite(
    sub: Any,
    name: str,
    about: str,
    *,
    out: str,
    plan: Callable[..., Plan],
    run: Callable[[Plan, Progress], Results],
    render: Callable[[Results], str],
) -> Options:
    """A suite's subcommand: its options fill ``plan``, ``run`` measures it and ``render`` turns
    the results into a Markdown table; ``python -m bench`` writes both under ``--out``."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=about)
    options = Options(parser, plan())
    options.add("out", default=Path(out))

    def handler(args: argparse.Namespace) -> Results:
        try:
            chosen = plan_from(plan, args)
        except ValueError as exc:  # the plan's own checks, said as the command line's error
            parser.error(str(exc))
        return run(chosen, say)

    parser.set_defaults(handler=handler, render=render)
    return options


def plan_from(plan: Callable[..., Plan], args: argparse.Namespace, **given: Any) -> Plan:
    """``plan`` filled from the options named after its fields (those left unset keep the plan's
    own default), and from ``given``."""
    names = {f.name for f in fields(cast(Any, plan))}
    chosen = {k: v for k, v in vars(args).items() if k in names and v is not None}
    return plan(**{**chosen, **given})


def require(
    plan: object, *, at_least_one: tuple[str, ...] = (), positive: tuple[str, ...] = ()
) -> None:
    """A plan's counts are >= 1 and its durations and rates > 0, or a ValueError names the
    field and its value."""
    for name in at_least_one:
        if getattr(plan, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(plan, name)}")
    for name in positive:
        if getattr(plan, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {getattr(plan, name)}")


def plan_json(plan: object) -> dict[str, Any]:
    """A plan as the results keep it: paths as strings."""
    assert is_dataclass(plan) and not isinstance(plan, type)
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(plan).items()}


def say(line: str) -> None:
    """A suite's progress, as it goes (the output may be a pipe)."""
    print(line, flush=True)
