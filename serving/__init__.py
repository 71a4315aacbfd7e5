"""The front half of shardserve: settings, HTTP API, dynamic batcher and metrics."""
