# The two commands of the README:  `make serve`  and  `make test`.
# Both create .venv and install the package (with its dev, bench and loadtest extras) on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
SERVE_ARGS ?= --model demo-mlp --stages 2

.PHONY: install serve test lint clean proto

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), f"shardserve needs Python 3.11, got {sys.version.split()[0]} (set PYTHON=...)"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,bench,loadtest,tracing]'
	@touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/shardserve serve $(SERVE_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest

# The gRPC stubs of serving/protocols/v2/proto, kept in the repo. They load into a descriptor pool of their
# own: tritonclient and the kserve SDK define the same `inference.*` messages in the default pool,
# and a process importing both would fail with "duplicate symbol".
PROTO := serving/protocols/v2/proto/grpc_service.proto
# TF Serving's and TensorFlow's messages (packages `tensorflow`, `tensorflow.serving`): they import
# each other, so they share ONE private pool (serving/protocols/tfserving/proto/__init__.py's POOL,
# which holds the well-known types they import too), not a fresh pool per file; TensorFlow's own
# tensor_pb2 and tensorflow-serving-api's stubs live in the default pool beside them.
TFS_PROTO_DIR := serving/protocols/tfserving/proto
TFS_PROTOS := $(wildcard $(TFS_PROTO_DIR)/*.proto)
TFS_SERVICES := $(TFS_PROTO_DIR)/prediction_service.proto $(TFS_PROTO_DIR)/model_service.proto
proto: install
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO)
	perl -pi -e 's/_descriptor_pool\.Default\(\)\.AddSerializedFile/_descriptor_pool.DescriptorPool().AddSerializedFile/' $(PROTO:.proto=_pb2.py)
	@grep -q 'DescriptorPool().AddSerializedFile' $(PROTO:.proto=_pb2.py)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. $(TFS_PROTOS)
	$(BIN)/python -m grpc_tools.protoc -I. --grpc_python_out=. $(TFS_SERVICES)
	perl -pi -e 's/_descriptor_pool\.Default\(\)\.AddSerializedFile/_tfs_pool.AddSerializedFile/; s/^(from google\.protobuf import descriptor_pool as _descriptor_pool)$$/$$1\nfrom serving.protocols.tfserving.proto import POOL as _tfs_pool/' $(TFS_PROTOS:.proto=_pb2.py)
	@! grep -l '_descriptor_pool.Default()' $(TFS_PROTOS:.proto=_pb2.py)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
