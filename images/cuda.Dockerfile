# CUDA training image: SFT / CPT / DPO / GKD (FSDP2 under torchrun, NCCL, bf16).
# torch==2.13.0 from PyPI is the CUDA build: it brings the CUDA runtime, cuDNN and NCCL as nvidia-*
# wheels, so a slim Python base is enough; the node provides only the NVIDIA driver (device plugin).
#
# Build (see images/README.md):
#   docker build -f images/cuda.Dockerfile -t ghcr.io/sao-kfp/sao-kfp-cuda:0.1.0 .
# TORCH_INDEX picks another CUDA flavour of the same torch version, e.g. https://download.pytorch.org/whl/cu128.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG PIP_CERT=
ARG TORCH_INDEX=
ENV PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false \
    SAO_CACHE_DIR=/var/cache/sao VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    NCCL_DEBUG=WARN
RUN set -eu; \
    packages="git ca-certificates"; \
    python3 -c "import venv, ensurepip" 2>/dev/null || packages="$packages python3 python3-venv"; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv /opt/venv
WORKDIR /opt/sao
COPY pyproject.toml README.md ./
COPY sao_core ./sao_core
COPY components ./components
COPY pipelines ./pipelines
RUN set -eu; \
    if [ -n "$PIP_CERT" ]; then export PIP_CERT; else unset PIP_CERT; fi; \
    index=""; if [ -n "$TORCH_INDEX" ]; then index="--index-url $TORCH_INDEX --extra-index-url https://pypi.org/simple"; fi; \
    pip install --no-cache-dir --upgrade pip; \
    pip install --no-cache-dir $index "torch==2.13.0"; \
    pip install --no-cache-dir ".[train]"; \
    pip install --no-cache-dir --no-deps "swebench==5.0.2"; \
    python -c "import torch; assert torch.version.cuda, 'the CUDA image got a CPU-only torch'"; \
    sao --quiet build-model
ENTRYPOINT ["sao"]
CMD ["--help"]
