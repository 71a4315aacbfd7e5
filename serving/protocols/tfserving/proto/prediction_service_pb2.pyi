from serving.protocols.tfserving.proto import get_model_metadata_pb2 as _get_model_metadata_pb2
from serving.protocols.tfserving.proto import inference_pb2 as _inference_pb2
from serving.protocols.tfserving.proto import predict_pb2 as _predict_pb2
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor
