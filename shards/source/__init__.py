"""Where a bundle comes from: a model named or given by path (a demo name, a .keras file, a
SavedModel, a keras_hub preset, a bundle directory) resolved to a bundle on this node, cut by the
partitioner when the cache has none (``resolve``), or resolved in a Ray task so that the caller
never imports TensorFlow (``remote``)."""
