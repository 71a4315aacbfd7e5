"""Side-by-side benchmarks: shardserve against the model's own ceiling, Ray Serve and LitServe.

Run ``python -m bench --help``. Nothing here is imported by ``serving`` or ``shards``.
"""
