"""``python -m bench protocols``: TF-Serving JSON, V2 JSON, V2 binary and gRPC in one run.

- ``run``: the plan, the parser and the loads.
- ``check``: every protocol's answers decoded and compared.
- ``report``: the table.
"""

from bench.suites.protocols.run import add_parsers

__all__ = ["add_parsers"]
