# One image for every vramguard component: `vramguard extender`, `vramguard webhook`,
# `vramguard agent` and the CLI (`vramguard explain|plan|audit|certs`, `kubectl-vram`).
# kube-scheduler is not in it: the second scheduler runs the upstream kube-scheduler image with
# the extender as a sidecar (see manifests/base/scheduler.yaml).
#
#   make image        (scripts/image.sh: Docker or podman; a local stand-in base without a registry)
#   docker build --build-arg VERSION=0.2.0 --build-arg REVISION=$(git rev-parse HEAD) \
#       --build-arg SOURCE=$(git remote get-url origin) -t vramguard:0.2.0 .
#
# The runtime stage writes nothing outside /tmp (mount an emptyDir there), so it runs with
# readOnlyRootFilesystem: true as the numeric non-root user 65532. Bytecode is compiled at build
# time, hash-based (reproducible, and never re-validated against timestamps), and
# PYTHONDONTWRITEBYTECODE keeps Python from trying to write more.
#
# The base: PYTHON_IMAGE, the official python image pinned by tag and by the digest of its
# multi-architecture index (linux/amd64 and linux/arm64). Check it where a registry is reachable:
#   docker buildx imagetools inspect python:3.11.14-slim-bookworm   (the "Digest:" line)
# (the project's CI machines reach no container registry: there the digest is not re-checked and
# the build runs on the stand-in base).
# Any Debian-based image with Python 3.11+ and the venv module works (a registry mirror, or the
# stand-in scripts/image.sh makes with mmdebstrap): --build-arg PYTHON_IMAGE=...
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

# --- dependencies: the locked dependencies in a virtualenv ------------------------------------
FROM ${PYTHON_IMAGE} AS dependencies

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# The target virtualenv gets no pip or setuptools; a second one holds the pip that installs
# into it (pip --python), so neither reaches the runtime stage.
RUN python -m venv --without-pip /opt/vramguard \
 && python -m venv /opt/pip

# Dependencies: their own layer, rebuilt only when requirements.lock changes. Every package,
# transitive ones included, is pinned with its hashes (wheels for amd64 and arm64).
# kubernetes/aio (the asyncio client, 68 of the package's 126 MB) goes: vramguard uses the
# synchronous client only, and nothing else imports it.
COPY requirements.lock /src/requirements.lock
RUN /opt/pip/bin/pip --python /opt/vramguard/bin/python install --no-compile --no-deps \
        --require-hashes --only-binary=:all: -r /src/requirements.lock \
 && rm -rf /opt/vramguard/lib/python3*/site-packages/kubernetes/aio \
 && /opt/vramguard/bin/python -m compileall -q --invalidation-mode unchecked-hash /opt/vramguard/lib

# --- builder: vramguard itself, on top of its dependencies -----------------------------------
FROM dependencies AS builder

# The code: the packages .dockerignore lets through (its allowlist is the one list of them).
# Only vramguard's own files are compiled and staged under /app (scripts/stage_app.py), so the
# runtime's last layer holds nothing of the dependencies.
COPY . /src
WORKDIR /src
RUN /opt/pip/bin/pip --python /opt/vramguard/bin/python install --no-compile --no-deps . \
 && /opt/vramguard/bin/python scripts/stage_app.py /app \
 && /opt/vramguard/bin/vramguard --help > /dev/null

# --- runtime ------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

ARG VERSION=0.0.0
ARG REVISION=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="vramguard" \
      org.opencontainers.image.description="VRAM-aware admission and scheduling for shared NVIDIA GPUs in Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}"

# A numeric user, so that runAsNonRoot can be verified by the kubelet without a passwd lookup.
# The base's own pip, setuptools and wheel go: nothing installs packages at run time.
RUN groupadd --system --gid 65532 vramguard \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin vramguard \
 && (python -m pip uninstall --yes --quiet pip setuptools wheel 2> /dev/null || true) \
 && rm -rf /usr/share/python-wheels /usr/local/bin/pip* /usr/local/lib/python3*/ensurepip /usr/lib/python3*/ensurepip

# Two layers: the dependencies (unchanged while requirements.lock is), then vramguard (~1 MB).
COPY --from=dependencies /opt/vramguard /opt/vramguard
COPY --from=builder /app/ /
COPY --from=builder /src/LICENSE /usr/share/doc/vramguard/LICENSE

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
