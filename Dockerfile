# syntax=docker/dockerfile:1
# Portico: the gateway and its engines in one image, run as a non-root user.
#
#   docker build -t portico .                                   # CPU torch
#   docker build -t portico:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#                                                               # NVIDIA GPUs (Triton kernels)
#
# deploy/compose/docker-compose.yml builds and runs it; docs/deployment.md explains the options.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------- build
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Models baked into the image (aliases of `portico models pull`); empty for none.
ARG PORTICO_MODELS="smollm2-135m"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/portico
ENV PATH=/opt/portico/bin:$PATH
# torch first and from its own index, so the CPU image does not pull a multi-GB CUDA build.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY portico ./portico
COPY gateway ./gateway
COPY engine ./engine
COPY load ./load
COPY policies ./policies
RUN pip install ".[otel]" \
 && for model in ${PORTICO_MODELS}; do portico models pull "$model"; done

# ---------------------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE}
# The engine builds its native CPU kernels (engine/kernels/cpu_kernels.c) for the CPU it runs
# on, the first time it starts, and Triton compiles a small launcher on GPUs: both use the
# system C compiler. Without it the engine still runs, on its slower PyTorch kernels.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 portico \
 && useradd --system --uid 10001 --gid portico --home-dir /var/lib/portico --create-home \
      --shell /usr/sbin/nologin portico \
 && mkdir -p /etc/portico /var/lib/portico/models /var/lib/portico/data \
 && chown -R portico:portico /var/lib/portico
COPY --from=build /opt/portico /opt/portico
ENV PATH=/opt/portico/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PORTICO_MODELS_DIR=/var/lib/portico/models \
    TRITON_CACHE_DIR=/var/lib/portico/.triton \
    HF_HOME=/var/lib/portico/.cache/huggingface
WORKDIR /var/lib/portico
USER 10001:10001
EXPOSE 8000
# Liveness of the gateway process; compose and Kubernetes probe /ready for traffic.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=3)"]
STOPSIGNAL SIGTERM
CMD ["portico", "serve", "--config", "/etc/portico/portico.yaml"]
