"""``python -m bench split``: layers split across devices against the same model in one stage
(issues 29 and 42), side by side in one run.

Two models (``--models``), each layer 128 MiB at the defaults: a recommender of two tables of
``--rows`` x ``--dim`` float32 (the item table read for a history of 20 ids and the candidate,
with ``mask_zero``); an MLP ``x -> fc1 (--hidden, relu) -> fc2 (--width) -> a score``. Each is
partitioned in a child (this process loads no TensorFlow) with no budget (one stage) and under a
budget of ``--budget-share`` of one table (of fc1), which splits the layers into parts of their
own (``--device-overhead-bytes 0``): the tables with the dense and with the routed lookup combine
(issue 42 item 2), the MLP paired (column then row: each part keeps its slice of the hidden
units and sends its partial sum; item 1) and unpaired (``pair_dense=False``: fc1 split by
columns, a stage that only joins, fc2 split by columns). Each layout is served by one pipeline
(``ReplicaSet``, no HTTP) on a private local Ray, one at a time, under ``--concurrency``
closed-loop callers of ``--batch`` rows for ``--seconds`` after ``--warmup``, in
``--repeats`` rounds (the order reversed every other round); the figures are the medians.

Per layout: rows/s, p50/p99 under load, the p50 of a batch alone, the bytes a batch puts in
Ray's shared-memory store (measured) and what crosses by the objects' sizes (computed,
``crossing``), the 1-min load average, and per actor its RSS above TensorFlow against the plan.

- ``models``: the two models and their batches.
- ``crossing``: the bytes per batch, computed and measured.
- ``run``: the plan, the layouts, the rounds and the medians.
- ``report``: the tables.
"""

from bench.suites.split.run import add_parsers

__all__ = ["add_parsers"]
