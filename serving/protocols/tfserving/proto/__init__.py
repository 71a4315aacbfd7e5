"""TF Serving's and TensorFlow's messages, compiled by ``make proto`` from the ``.proto`` files
here (the same packages, ``tensorflow`` and ``tensorflow.serving``, names and field numbers as
theirs), in one descriptor pool of their own: ``POOL``.

They import each other (a ``PredictRequest`` holds ``TensorProto``s), so one pool holds the whole
set, with the well-known types they import; not the default pool, where TensorFlow's own
``tensor_pb2`` and the ``tensorflow-serving-api`` stubs register the same names (a process that
imports both would fail with "duplicate symbol"). The front end never imports TensorFlow.
"""

from google.protobuf import any_pb2, descriptor_pool, wrappers_pb2

POOL = descriptor_pool.DescriptorPool()
for _known in (any_pb2, wrappers_pb2):
    POOL.AddSerializedFile(_known.DESCRIPTOR.serialized_pb)
