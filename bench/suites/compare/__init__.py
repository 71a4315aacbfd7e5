"""``python -m bench run`` and ``report``: shardserve against the ceiling, Ray Serve and LitServe.

- ``run``: the measurement plan and the parsers of ``run`` and ``report``.
- ``report``: ``docs/benchmarks.md``'s tables and plots.
"""

from bench.suites.compare.run import add_parsers

__all__ = ["add_parsers"]
