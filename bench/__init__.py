"""Side-by-side benchmarks: shardserve against the model's own ceiling, Ray Serve and LitServe.

Run ``python -m bench --help``. Nothing here is imported by ``serving`` or ``shards``.

- ``bench/suites/``: one module per suite of ``python -m bench``, or a folder per suite of
  several parts (``run.py``: its plan and parser; ``report.py``, ``check.py`` ...; ``compare`` is
  ``run`` and ``report``); ``bench/options.py``: the options their parsers share.
- ``bench/load/``: the load generators (wrk and hey driven from here; ``python -m
  bench.load.pyload`` and ``bench.load.grpcload`` as processes of their own).
- ``bench/observe/``: the server and the machine seen from outside (``/metrics``, ``/proc``).
- ``bench/systems/``: the servers under test, started and stopped; ``bench/models/``: the models
  they serve.
"""
