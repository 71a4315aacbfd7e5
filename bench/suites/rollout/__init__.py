"""``python -m bench rollout``: a version switch under load and canaries that roll back.

- ``run``: the plan, the parser and the two parts in order.
- ``server``: the server and model repository each part drives.
- ``switch``: a new version under load.
- ``canary``: a canary that rolls back on its own.
- ``report``: the table.
"""

from bench.suites.rollout.run import add_parsers

__all__ = ["add_parsers"]
