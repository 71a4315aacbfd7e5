# syntax=docker/dockerfile:1
#
# One image, two roles:
#   - the HTTP front end:      docker run --gpus all -p 8000:8000 IMAGE
#   - a node of a Ray cluster: `ray up deploy/aws-gpu.yaml` runs `docker run ... IMAGE bash` and
#     then `ray start` inside it, so the server start is a CMD (replaced by that `bash`), never an
#     ENTRYPOINT (which would swallow it).
#
# Build: docker build -t shardserve:0.1.0 .

ARG PYTHON_VERSION=3.11

# ---------------------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS builder

# Every node of a cluster and the machine that runs `ray up` must run the very same Ray; pyproject
# only bounds it to a minor series, so the image pins the patch release.
ARG RAY_VERSION=2.60.0

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md ./
COPY serving/ serving/
COPY shards/ shards/
COPY loadtest/ loadtest/

# The gpu extra brings tensorflow[and-cuda]: CUDA and cuDNN come as wheels, so the base image
# needs no CUDA toolkit, only a host with the NVIDIA driver and container toolkit.
# boto3: the head node's autoscaler launches the AWS worker nodes.
RUN pip install "./[gpu]" "ray[default]==${RAY_VERSION}" "boto3>=1.34,<2"

# ---------------------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime

# The Ray cluster launcher rsyncs its bootstrap files into the container, and the head's
# autoscaler reaches the worker nodes over ssh. Upstream versions pinned, Debian security
# updates (the +deb12uN suffix) allowed.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        "openssh-client=1:9.2p1-*" \
        "rsync=3.2.7-*" \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 --shell /bin/bash shardserve

COPY --from=builder /opt/venv /opt/venv

# HOME is set explicitly because the Ray launcher reads it from the image config to decide where
# `~/ray_bootstrap_config.yaml` is mounted; without it it assumes /root, which this user cannot
# read.
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/shardserve \
    PYTHONUNBUFFERED=1 \
    TF_CPP_MIN_LOG_LEVEL=2 \
    RAY_USAGE_STATS_ENABLED=0 \
    SHARDSERVE_HOST=0.0.0.0 \
    SHARDSERVE_PORT=8000 \
    SHARDSERVE_MODEL=demo-mlp \
    SHARDSERVE_CACHE_DIR=/home/shardserve/.cache/shardserve

# Numeric, so that runtimes that enforce non-root (Kubernetes runAsNonRoot) can verify it.
USER 1000:1000
WORKDIR /home/shardserve

# 8000 HTTP, 8001 gRPC (Open Inference Protocol); 6379 Ray GCS, 8265 Ray dashboard, 10001 Ray
# client (cluster nodes only).
EXPOSE 8000 8001 6379 8265 10001

# Loading and warming a large model takes minutes: the start period keeps Docker from calling the
# container unhealthy before /healthz can answer.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SHARDSERVE_PORT', '8000') + '/healthz', timeout=4)"]

CMD ["shardserve", "serve", "--host", "0.0.0.0"]
