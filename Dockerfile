# syntax=docker/dockerfile:1
# The storage node's image. Settings come only from NODE_* variables (README "Configuration");
# Kubernetes sets them from the ConfigMap in manifests/.
#   docker build -t storage-node:0.1.0 .
#   docker run --rm -p 8080:8080 -e NODE_ADMIN_TOKEN=... storage-node:0.1.0
# tests/deploy/test_dockerfile.py runs the build stage's steps and checks the rest.

# The Python of pyproject's requires-python and of the test suite (the test checks both).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: the wheel, installed with pinned dependencies into a virtual environment -------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    VENV=/opt/storage-node
WORKDIR /src
# The locked dependencies first, in a layer of their own (the lock holds the runtime's and
# nothing else): a change to the node's code rebuilds only the layers below, not ~30 s of pip.
COPY requirements.lock ./
RUN python -m venv "$VENV" \
 && "$VENV/bin/python" -m pip install --requirement requirements.lock
COPY pyproject.toml README.md ./
COPY node ./node
# The wheel alone (--no-deps), then the node from it with every dependency at the version of
# requirements.lock: no dev extras, nothing unpinned (one the lock lacks would be installed,
# and the image test finds it).
RUN python -m pip wheel --no-deps --wheel-dir dist . \
 && "$VENV/bin/python" -m pip install --constraint requirements.lock dist/storage_node-*.whl

# --- runtime: the interpreter and the virtual environment, nothing else --------------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="storage-node" \
      org.opencontainers.image.description="A bookie-style storage node for append-only data: WAL (file journal or raw block device), entry logs, RocksDB index, HTTP API" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11-slim-bookworm"
# A fixed uid/gid (the StatefulSet's runAsUser/runAsGroup): files on a volume keep an owner
# that means the same in every release.
RUN groupadd --system --gid 10001 node \
 && useradd --system --uid 10001 --gid node --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin node \
 && mkdir /data \
 && chown node:node /data
COPY --from=build /opt/storage-node /opt/storage-node
# The node listens on every interface (a container's loopback is its own) and keeps its data
# in /data, the volume's mount point.
ENV PATH=/opt/storage-node/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NODE_DATA_DIR=/data \
    NODE_HTTP_HOST=0.0.0.0 \
    NODE_HTTP_PORT=8080
USER 10001:10001
WORKDIR /data
EXPOSE 8080
# The same check as the liveness probe; python is here, curl is not.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/heartbeat' % os.environ.get('NODE_HTTP_PORT', '8080'), timeout=4)"]
# SIGTERM: stop accepting, finish requests, final checkpoint (node/http/app.py).
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "node"]
CMD ["serve"]
