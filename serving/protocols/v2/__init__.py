"""The Open Inference Protocol (KServe V2) over HTTP/REST and gRPC, on the same batcher as
``/predict``."""
