"""Rows from many requests become batches for one async ``run_batch``: the batcher and its
supervised loop (``batcher``), sending and running batches (``dispatch``), one batch run and its
poison rows found (``poison``), the row queues (``rows``), the wait policies (``wait``), the
batching settings (``settings``), the cost model (``cost``) and what a batch did (``record``).
Pure asyncio and numpy: no HTTP, no Ray, no TensorFlow."""
