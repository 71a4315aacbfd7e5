"""The back half of shardserve: partition Keras models into stages and run them on Ray actors.

Nothing here imports ``serving``, FastAPI or uvicorn. TensorFlow and Ray are imported lazily by
the modules that need them (``partition``, ``models``, ``actor``, ``pipeline``), so that
``shards.signature`` and ``shards.bundle.format``'s manifest reader stay importable without them.
"""
