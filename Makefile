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
	$(BIN)/python -m pip install --quiet -e '.[dev,bench,loadtest]'
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
proto: install
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO)
	perl -pi -e 's/_descriptor_pool\.Default\(\)\.AddSerializedFile/_descriptor_pool.DescriptorPool().AddSerializedFile/' $(PROTO:.proto=_pb2.py)
	@grep -q 'DescriptorPool().AddSerializedFile' $(PROTO:.proto=_pb2.py)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
