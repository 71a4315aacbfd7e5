"""A partitioned model on disk: the bundle's format and manifest, the cache of bundles keyed by
fingerprint, resolving a model name or path to a bundle (here or in a Ray task), and shipping
stage files to the nodes that lack them."""
