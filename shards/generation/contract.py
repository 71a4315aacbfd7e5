"""What the front end (``serving/generation/``) and the back end (``shards/generation/``) agree on.

Plain dataclasses and a Protocol: no TensorFlow, no Ray, so the front end and its fakes import
this without either. The contract is written in /work/notes/generation_interface.md (issue 39).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "GenerationInfo",
    "GenerationReplica",
    "ReplicaLost",
    "RowResult",
    "RowStep",
    "Sampling",
    "StepFailed",
]


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    # The draw for generated token t is keyed by (seed, t): repeatable alone, batched, or after a
    # re-prefill.
    seed: int | None = None
    # An unseeded sampled row's key, drawn by the scheduler at the request's arrival: its draws
    # are keyed by (draw_key, t) as a seeded row's, so that a re-prefill (a preemption, a lost
    # replica) draws the same tokens. None (and no seed): the actor's own generator.
    draw_key: int | None = None


@dataclass(frozen=True)
class RowStep:
    slot: int  # KV slot, the same index in every stage of the replica
    # New tokens: the whole prompt at prefill (prompt + generated so far when re-prefilled after a
    # fault), exactly one id at decode.
    token_ids: tuple[int, ...]
    position: int  # position of token_ids[0] in the sequence (0 at prefill)
    sampling: Sampling
    token_index: int  # index of the token this step samples among the generated ones (0 = first)


@dataclass(frozen=True)
class RowResult:
    slot: int
    token_id: int  # sampled id for the row's last new token
    logprob: float  # its log-probability under the (temperature-scaled) distribution


@dataclass(frozen=True)
class GenerationInfo:  # fixed at load
    model_family: str  # "gpt2", "llama", ...
    vocabulary_size: int
    max_length: int  # slot length: positions 0 .. max_length-1
    kv_slots: int  # slots per replica (--kv-slots)
    stages: int
    end_token_ids: tuple[int, ...]  # the preset's end token(s): default stop ids
    start_token_id: int | None  # prepended to a text prompt when the preset's preprocessor does
    # Directory holding the preset's tokenizer assets (vocabulary.json + merges.txt for GPT-2
    # byte-level BPE; vocabulary.spm for Llama), None = token ids only.
    tokenizer_dir: str | None
    tokenizer_kind: str | None  # "byte_bpe" | "sentencepiece" | None
    # Parts the LM head is split into by vocabulary rows, each its own actor (issue 42); 1 = the
    # last stage holds the head.
    head_parts: int = 1


class StepFailed(Exception):
    """The model raised on these rows (one row's bad input): the rows fail alone."""

    def __init__(self, message: str, slots: Sequence[int]) -> None:
        super().__init__(message)
        self.message = message
        self.slots = tuple(slots)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.slots))


class ReplicaLost(Exception):
    """A stage died / hung: every slot of this replica is lost.

    After ``await replica.wait_ready()`` the scheduler re-prefills its sequences from their tokens
    so far.
    """


class GenerationReplica(Protocol):
    info: GenerationInfo

    async def step(self, rows: Sequence[RowStep]) -> list[RowResult]:
        """One forward pass of the rows through every stage.

        Prefill rows and decode rows may be mixed; each row at its own position. Results in the
        order of ``rows``. Several step() calls may be in flight at once (K groups for K stages):
        they pipeline, each stage takes them in call order. Raises StepFailed or ReplicaLost.
        """
        ...

    async def wait_ready(self) -> None:
        """Returns once the replica (after a ReplicaLost) is rebuilt/restarted and warm."""
        ...

    async def close(self) -> None: ...
