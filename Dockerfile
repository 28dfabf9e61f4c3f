# syntax=docker/dockerfile:1.7
#
# One image for every vramguard component: `vramguard extender`, `vramguard webhook`,
# `vramguard agent` and the CLI (`vramguard explain|plan|audit|certs`, `kubectl-vram`).
# kube-scheduler is not in it: the second scheduler runs the upstream kube-scheduler image with
# the extender as a sidecar (see manifests/base/scheduler.yaml).
#
#   docker build -t vramguard:0.1.0 .
#
# The runtime stage writes nothing outside /tmp (mount an emptyDir there), so it runs with
# readOnlyRootFilesystem: true as the numeric non-root user 65532. Bytecode is compiled at build
# time and PYTHONDONTWRITEBYTECODE keeps Python from trying to write more.
# Pin the base image by digest too in your registry mirror (`python:3.11.14-slim-bookworm@sha256:...`).

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# --- builder: build the wheel, install it with its pinned dependencies into a virtualenv --------
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
# The package metadata first, so that dependency layers are reused while only the code changes.
COPY pyproject.toml README.md ./
COPY vramguard ./vramguard
COPY extender ./extender
COPY webhook ./webhook
COPY agent ./agent

RUN python -m venv /opt/vramguard \
 && /opt/vramguard/bin/pip install pip==26.3 \
 && /opt/vramguard/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/vramguard/bin/pip install /wheels/vramguard-*.whl \
 && /opt/vramguard/bin/python -m compileall -q /opt/vramguard/lib \
 && /opt/vramguard/bin/pip uninstall --yes pip \
 && /opt/vramguard/bin/vramguard --help > /dev/null

# --- runtime ------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="vramguard" \
      org.opencontainers.image.description="VRAM-aware admission and scheduling for shared NVIDIA GPUs in Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"

# A numeric user, so that runAsNonRoot can be verified by the kubelet without a passwd lookup.
RUN groupadd --system --gid 65532 vramguard \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin vramguard

COPY --from=builder /opt/vramguard /opt/vramguard

# NVIDIA_VISIBLE_DEVICES=void: no GPU unless a pod asks; the agent's DaemonSet sets "all" so the
# NVIDIA container runtime injects libnvidia-ml (the "utility" capability) for NVML.
ENV PATH=/opt/vramguard/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    NVIDIA_VISIBLE_DEVICES=void \
    NVIDIA_DRIVER_CAPABILITIES=utility

USER 65532:65532
WORKDIR /tmp

ENTRYPOINT ["vramguard"]
CMD ["--help"]
