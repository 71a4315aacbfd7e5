"""``python -m bench generate``: iteration-level against request-level batching.

- ``run``: the plan, the parser and the systems.
- ``report``: the summaries and the table.
- ``streamed``: the streamed path against the plain one on one server (issue 40, ``--streamed``).
- ``priorities``: ``--priorities``, high-priority TTFT under a saturating low load (issue 41).
"""

from bench.suites.generate.run import add_parsers

__all__ = ["add_parsers"]
