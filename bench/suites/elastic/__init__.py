"""``python -m bench elastic``: replicas that follow a load step.

- ``run``: the plan, the parser and the load step.
- ``check``: the replica counts and latencies read back.
- ``report``: the table.
"""

from bench.suites.elastic.run import add_parsers

__all__ = ["add_parsers"]
