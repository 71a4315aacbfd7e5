"""``python -m bench ragged``: rows of different lengths batched together.

- ``run``: the plan, the parser and the servers.
- ``check``: the answers against unpadded rows, the padding wasted.
- ``report``: the table.
"""

from bench.suites.ragged.run import add_parsers

__all__ = ["add_parsers"]
