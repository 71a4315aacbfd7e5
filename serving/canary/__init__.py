"""A canary's pure parts (no FastAPI, Ray, gRPC or TensorFlow): each version's sliding window of
answered requests (``window``), the verdict that holds, rolls back or promotes a canary
(``judge``), and the weighted split of unversioned requests (``split``). The controller that
wires them to served versions is ``serving.canary.controller``.

Nothing is re-exported here: importers name the module (``serving.canary.judge``), which keeps
the chain of module-level imports short (tests/layout)."""
