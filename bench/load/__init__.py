"""Load generators: ``wrk`` and ``hey`` driven from here, and the ones that run as processes of
their own (``python -m bench.load.pyload``, ``python -m bench.load.grpcload``); the chaos bench's
traffic and shard-actor killer."""
