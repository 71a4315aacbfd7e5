"""``python -m bench.tied_hop``: what a tied table held once would cost a generation step (issue 42
item 3's generation analog; measured, not built).

With ``--head-parts P`` a tied model's stage 0 keeps the whole token table for its lookup while
the P head parts hold its rows again for the logits: the table is held twice. Held once, stage 0
would ask the parts for each step's rows (the ids to every part, each returning the rows it owns),
one more actor hop on every step before the blocks run.

This prints (JSON) the bytes held twice, from the plan, and times one decode step both ways on
Ray actors side by side, alternating, one step in flight: the stages are stand-ins that only pass
the hidden states on (so the difference is the hop, not the model), the parts hold real slices of
a random table and answer the lookup (routed rows) and each row's max logit over their rows.

    PYTHONPATH=. python -m bench.tied_hop --vocab 50257 --hidden 768 --rows 8 --parts 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from typing import Any

import numpy as np

MiB = 1 << 20


class _Stage:
    """A stand-in stage: stage 0 looks its ids up in its own table (``table``) or joins the
    parts' routed rows; later stages pass the hidden states on."""

    def __init__(self, vocab: int, hidden: int, table: bool) -> None:
        rng = np.random.default_rng(0)
        self.table = rng.standard_normal((vocab, hidden), np.float32) if table else None

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        assert self.table is not None
        return self.table[ids]

    def join(self, rows: int, *found: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        out = np.zeros((rows, found[0][1].shape[1]), np.float32)
        for positions, vectors in found:
            out[positions] = vectors
        return out

    def forward(self, hidden: np.ndarray) -> np.ndarray:
        return hidden


class _Part:
    """A head part: rows ``[start, stop)`` of the table."""

    def __init__(self, start: int, stop: int, hidden: int) -> None:
        rng = np.random.default_rng(start)
        self.start, self.stop = start, stop
        self.rows = rng.standard_normal((stop - start, hidden), np.float32)

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mine = np.flatnonzero((ids >= self.start) & (ids < self.stop)).astype(np.int32)
        return mine, self.rows[ids[mine] - self.start]

    def summarize(self, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits = hidden @ self.rows.T
        return logits.max(axis=1), logits.argmax(axis=1) + self.start


def run(vocab: int, hidden: int, rows: int, parts: int, steps: int) -> dict[str, Any]:
    import ray

    from shards.generation.head_merge import slice_bounds

    ray.init(
        address="local", num_cpus=4 + parts, include_dashboard=False, logging_level=logging.WARNING
    )
    try:
        stage: Any = ray.remote(num_cpus=1)(_Stage)
        part: Any = ray.remote(num_cpus=1)(_Part)
        twice = [stage.remote(vocab, hidden, True), stage.remote(vocab, hidden, False)]
        once = [stage.remote(vocab, hidden, False), stage.remote(vocab, hidden, False)]
        heads = [part.remote(a, b, hidden) for a, b in slice_bounds(vocab, parts)]
        rng = np.random.default_rng(1)

        def step_twice(ids: np.ndarray) -> Any:
            h = twice[1].forward.remote(twice[0].lookup.remote(ids))
            return ray.get([p.summarize.remote(h) for p in heads])

        def step_once(ids: np.ndarray) -> Any:
            found = [p.lookup.remote(ids) for p in heads]
            h = once[1].forward.remote(once[0].join.remote(len(ids), *found))
            return ray.get([p.summarize.remote(h) for p in heads])

        times: dict[str, list[float]] = {"twice": [], "once": []}
        for i in range(steps + 20):
            ids = rng.integers(0, vocab, rows).astype(np.int32)
            order = (("twice", step_twice), ("once", step_once))
            for name, step in order if i % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                step(ids)
                if i >= 20:  # the first rounds warm the workers
                    times[name].append(time.perf_counter() - start)
        ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    finally:
        ray.shutdown()
    table = vocab * hidden * 4
    return {
        "vocab": vocab,
        "hidden": hidden,
        "rows": rows,
        "parts": parts,
        "steps": steps,
        "table_held_twice_mib": round(table / MiB, 1),
        "lookup_bytes_to_parts": rows * 4 * parts,
        "lookup_bytes_back": rows * (hidden * 4 + 4),
        "step_ms_table_twice": round(ms["twice"], 3),
        "step_ms_table_once": round(ms["once"], 3),
        "hop_ms": round(ms["once"] - ms["twice"], 3),
        "once_over_twice": round(ms["once"] / ms["twice"], 3),
        "load": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--parts", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(json.dumps(run(args.vocab, args.hidden, args.rows, args.parts, args.steps), indent=1))


if __name__ == "__main__":
    main()
