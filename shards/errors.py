"""The exception tree of ``shards``: every error that leaves the package is one of these.

Errors from below (Ray, TensorFlow) are translated here, at the package boundary, into one-line
reasons: a Ray error's ``str()`` is a remote traceback with ANSI colours, a pid, a node IP and an
actor id, none of which may reach a client. The full detail goes to the log where it is caught.

    ShardsError
    ├── PlanError                 the model cannot be cut as asked (budget, stage count)
    ├── PartitionError            the graph cannot be cut or saved (unsupported layer, no signature)
    ├── ResolveError              --model names nothing servable
    ├── BundleError               a bundle on disk is missing, unreadable or inconsistent
    ├── StartError                the pipelines did not come up
    │   ├── InsufficientResourcesError   the cluster can never hold them
    │   └── PipelineStartError           a placement group or an actor did not start in time
    └── RunError                  a batch did not complete
        ├── ModelError            the model raised on the batch (its input may be to blame)
        ├── ReplicaLostError      a stage process died under the batch (twice, with the retry)
        ├── StageTimeoutError     the batch ran past the watchdog's limit (twice with the retry,
        │                         once where no other replica was healthy to retry on)
        └── NoHealthyReplicaError no replica is healthy now (carries when to retry)
            └── ReplicaRecoveringError  ... and one is being brought back: the batch may wait

The planning errors are also ``ValueError`` (bad arguments), the start errors ``RuntimeError``,
so callers that caught those before still do.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

# Exceptions that bad input raises inside an op: worth isolating the rows that trigger them.
# Others (out of memory, an internal error) are not the input's fault.
INPUT_ERRORS = frozenset(
    {
        "InvalidArgumentError",
        "OutOfRangeError",
        "ValueError",
        "TypeError",
        "IndexError",
        "KeyError",
        "FloatingPointError",
    }
)


__all__ = [
    "INPUT_ERRORS",
    "BundleError",
    "InsufficientResourcesError",
    "ModelError",
    "NoHealthyReplicaError",
    "PartitionError",
    "PipelineStartError",
    "PlanError",
    "ReplicaLostError",
    "ReplicaRecoveringError",
    "ResolveError",
    "RunError",
    "ShardsError",
    "StageTimeoutError",
    "StartError",
    "one_line",
    "scrub",
]


class ShardsError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))


class PlanError(ShardsError, ValueError):
    pass


class PartitionError(ShardsError, ValueError):
    pass


class ResolveError(ShardsError, ValueError):
    pass


class BundleError(ShardsError, ValueError):
    pass


class StartError(ShardsError, RuntimeError):
    pass


class InsufficientResourcesError(StartError):
    """The cluster cannot hold what the pipeline asks for, so placing it would hang forever."""


class PipelineStartError(StartError):
    """A placement group or a shard actor did not come up."""


class RunError(ShardsError):
    # Set on a replica fault that this batch did not cause: it was queued behind the batch that
    # hung or killed the stage. Not pickled: it only matters inside the driver.
    victim: bool = False


class ModelError(RunError):
    """The model raised on a batch; ``input_blamed`` when the error is of a kind bad input
    causes (an index out of range, a shape or value the op refuses), so that isolating the
    rows that trigger it is worth the reruns."""

    def __init__(self, message: str, input_blamed: bool = False) -> None:
        super().__init__(message)
        self.input_blamed = input_blamed

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.input_blamed))


class ReplicaLostError(RunError):
    pass


class StageTimeoutError(RunError):
    pass


class NoHealthyReplicaError(RunError):
    """No replica can take the batch now; ``retry_after_s``: when one is expected back."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.retry_after_s))


class ReplicaRecoveringError(NoHealthyReplicaError):
    """No replica is in the rotation, and one is being brought back: the batch did not run (or
    was lost with the replica) and may run once one is back. ``back`` is done then: with None
    when a replica rejoined, with the reason when its recovery failed. ``suspect``: the batch
    was the oldest on the replica when a stage died, so it may be what killed it. Not pickled
    with ``back``: it only matters inside the driver."""

    def __init__(
        self,
        message: str,
        retry_after_s: float = 1.0,
        back: asyncio.Future[str | None] | None = None,
        suspect: bool = False,
    ) -> None:
        super().__init__(message, retry_after_s)
        self.back = back
        self.suspect = suspect


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# What a remote error's text may carry that no client may see: "pid=123", "ip=10.0.0.1",
# "actor_id=ab12...", "<shards.actor.stage_actor.ShardActor object at 0x7f...>", IPv4 and
# IPv6 addresses (with a port or a zone), and the names of hosts on a private network.
_HEX4 = r"[0-9A-Fa-f]{1,4}"
_LEAKS = re.compile(
    r"\(?\b(pid|ip|actor_id|repr|node_id|worker_id|task_id)=(<[^<>]*>|[^,)\s]*)[,)]?\s*"
    r"|<[^<>]* at 0x[0-9a-fA-F]+>"
    # Host names before addresses: "ip-10-0-0-12" must go whole, not leave its digits behind.
    r"|\b(?!threading\.local\b)(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+"
    r"(?:internal|local|localdomain|lan|corp|intra|intranet|arpa|amazonaws\.com|cloudapp\.net"
    r"|googleusercontent\.com)\b(?::\d+)?"
    r"|\bip-\d{1,3}(?:-\d{1,3}){3}\b(?::\d+)?"
    r"|\blocalhost\b(?::\d+)?"
    # IPv6: eight groups, or fewer around "::", optionally bracketed with a port.
    rf"|\[?(?<![\w:])(?:(?:{_HEX4}:){{7}}{_HEX4}"
    rf"|(?:{_HEX4}(?::{_HEX4})*)?::(?:{_HEX4}(?::{_HEX4})*)?(?:\.\d{{1,3}}){{0,3}})"
    r"(?:%\w+)?(?![\w:])\]?(?::\d+)?"
    r"|\b\d{1,3}(\.\d{1,3}){3}(:\d+)?\b"
)
# Absolute paths (POSIX, home-relative, Windows) become their last part: the file a client
# named is still recognisable, the layout of the server's disks is not. A path needs two parts
# so that a route in a message ("GET /readyz") is left alone.
_PATH_PART = r"[^\s/\\'\"`,;:()\[\]{}<>|]+"
_PATHS = re.compile(
    rf"(?<![\w.~/\\-])~?(?:/{_PATH_PART}){{2,}}/?"
    rf"|~/{_PATH_PART}(?:/{_PATH_PART})*/?"
    rf"|\b[A-Za-z]:\\(?:{_PATH_PART}\\)*{_PATH_PART}\\?"
)
_MAX_CHARS = 300
# A shards error raised in a remote actor's __init__ reaches the driver only as the text of
# Ray's error (a traceback); its last line is the reason the user needs.
_REMOTE_SHARDS_ERROR = re.compile(r"^shards\.errors\.(\w+): (.+)$", re.MULTILINE)


def one_line(exc: BaseException) -> str:
    """``TypeName: first line of the message``, scrubbed of colours, pids, addresses, host names,
    ids and reprs, with absolute paths cut to their last part (``scrub``).

    For a TensorFlow error the useful line is its first (``indices[0,3] = 1000 is not in
    [0, 10)``); the node and graph context TensorFlow appends after it is dropped.
    """
    text = _ANSI.sub("", str(getattr(exc, "message", None) or exc))
    remote = _REMOTE_SHARDS_ERROR.findall(text)
    if remote:
        name, reason = remote[-1]
        return _clip(f"{name}: {scrub(reason)}")
    lines = [line for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith("Graph execution error"):
        # "Graph execution error:", "Detected at node X defined at:", an indented Python
        # stack, then the op's own message flush left: that last part is the reason.
        lines = [
            line for line in lines[1:] if not line.startswith((" ", "\t", "Detected at node"))
        ] or lines
    first = lines[0].strip() if lines else ""
    first = scrub(first)
    # TensorFlow appends "\n\t [[{{node ...}}]]" or " [Op:...]" to the op's message, and an op
    # inside a function (a cond's branch) comes prefixed with "{{function_node NAME}}".
    first = re.split(r"\s*\[\[|\s*\[Op:", first)[0].strip()
    first = re.sub(r"^(\{\{function_node [^}]*\}\}\s*)+", "", first)
    name = type(exc).__name__
    return _clip(f"{name}: {first}" if first else name)


def scrub(text: str) -> str:
    """``text`` without what no client may see: pids, ids, reprs, addresses and host names are
    removed, absolute paths cut to their last part."""
    text = _PATHS.sub(_last_part, text)
    return re.sub(r"  +", " ", _LEAKS.sub("", text)).strip()


def _last_part(match: re.Match[str]) -> str:
    return re.split(r"[/\\]", match.group(0).rstrip("/\\"))[-1]


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 3] + "..."
