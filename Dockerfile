# loraserve images, one per role (docs/design.md §10.1): each installs the wheel with its role's extra only.
#   docker build --target worker   -t loraserve-worker .    # JAX worker (CPU; use the tpu extra on TPU VMs)
#   docker build --target registry -t loraserve-registry .  # SQLAlchemy/Alembic, PostgreSQL, GCS
#   docker build --target router   -t loraserve-router .    # the base install + the http extra (OpenAI API)
#   docker build --target client   -t loraserve-client .    # the SDK and the `loraserve` CLI's client side
#   docker build --target demo     -t loraserve-demo .      # builds the tiny demo model/adapters (torch, peft)
# docker-compose.yml builds each service from its role's target.

# ---- build: generate the gRPC modules and build one wheel (grpcio-tools lives here only)
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN pip install "grpcio-tools>=1.66,<2" "setuptools>=77" wheel
COPY pyproject.toml README.md ./
COPY command ./command
COPY protos ./protos
COPY common ./common
COPY adapters ./adapters
COPY kernels ./kernels
COPY models ./models
COPY engine ./engine
COPY worker ./worker
COPY registry ./registry
COPY router ./router
COPY httpapi ./httpapi
COPY client ./client
RUN python protos/build.py && pip wheel --no-deps --no-build-isolation -w /wheels .

# ---- the base every role starts from
FROM python:3.11-slim AS base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY --from=build /wheels /wheels
# Servers run as this unprivileged user (uid 10001, as the Kubernetes manifests' runAsUser).
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin loraserve \
    && mkdir -p /assets /cache && chown 10001 /assets /cache
EXPOSE 50051 50061 50071 8000 9100
ENTRYPOINT []
CMD ["loraserve", "--help"]

FROM base AS client
RUN pip install /wheels/loraserve-*.whl
USER 10001

FROM base AS router
RUN pip install "$(ls /wheels/loraserve-*.whl)[http]"
USER 10001

FROM base AS registry
RUN pip install "$(ls /wheels/loraserve-*.whl)[registry,postgres,gcs]"
USER 10001

FROM base AS worker
# A C++ compiler for the CPU multi-LoRA kernels, built now (-march=native, cached by CPU flags: a host with
# another CPU rebuilds them once at start, ~4 s; without a compiler workers fall back to the xla backend).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install "$(ls /wheels/loraserve-*.whl)[worker,gcs,http]"
# Prebuilt kernels in a folder every user can read (the server runs as uid 10001).
ENV LORASERVE_KERNEL_CACHE_DIR=/opt/loraserve/kernels
RUN python -c "from loraserve.kernels import cpu; cpu.ensure_registered()" && chmod -R a+rX /opt/loraserve
USER 10001

FROM worker AS demo
# torch only builds the demo's tiny model and adapters. Point PIP_INDEX_URL/PIP_EXTRA_INDEX_URL (build
# args) at a CPU wheel index to keep the image small; the default index serves a CUDA build.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
USER root
RUN pip install "$(ls /wheels/loraserve-*.whl)[demo]"
USER 10001
