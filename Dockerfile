# loraserve: one image for the registry, the workers, the router and the admin CLI (CPU JAX).
# The tiny demo model and adapters are built at start by the compose `assets` job (needs the dev extra:
# torch, transformers, peft); a production image would install `.[gcs,postgres]` and mount real checkpoints.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
# torch is needed only to build the demo model and adapters. Point PIP_INDEX_URL/PIP_EXTRA_INDEX_URL
# (build args) at a CPU wheel index to keep the image small; the default index serves a CUDA build.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
RUN pip install torch==2.13.0
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY kernels ./kernels
COPY worker ./worker
COPY registry ./registry
COPY router ./router
COPY client ./client
RUN pip install ".[dev,gcs,postgres]" && python -m loraserve.protos.build && pip install --no-deps --force-reinstall .
# Build the C++ multi-LoRA kernels now (-march=native, cached by CPU flags: a host with another CPU
# rebuilds them once at start, ~4 s; without a compiler workers fall back to the xla backend).
RUN cd / && python -c "import kernels.cpu as c; c.ensure_registered()"
EXPOSE 50051 50061 50071
ENTRYPOINT []
CMD ["loraserve", "--help"]
