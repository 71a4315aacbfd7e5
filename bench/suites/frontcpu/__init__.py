"""``python -m bench frontcpu``: the front end's CPU per request, this tree against another.

- ``run``: the plan, the parser and the servers per tree.
- ``report``: the summaries and the table.
"""

from bench.suites.frontcpu.run import add_parsers

__all__ = ["add_parsers"]
