"""The back half of shardserve: partition Keras models into stages and run them on Ray actors.

``partition/`` cuts a model into stages (graph, plan, memory plan); ``bundle/`` keeps the stages
on disk (format, cache, resolve, shipping to nodes); ``cluster`` starts or joins Ray;
``pipeline/`` runs batches over replicas of stage actors and keeps them healthy; ``actor/`` is
what runs inside one stage actor. ``errors`` and ``signature`` are shared by all of them.

Nothing here imports ``serving``, FastAPI or uvicorn. Keras and TensorFlow are imported only by
the modules that cut a model or load a stage, so that ``shards.signature`` and
``shards.bundle.format``'s manifest reader stay importable without them.
"""
