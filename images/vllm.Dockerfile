# vLLM rollout image: rollout services, the colocated RL learner (SAO, GRPO baselines) and evaluation.
# vllm==0.32.0 from PyPI is built against the CUDA torch==2.13.0 from PyPI; the training core is
# installed too (the RL learner runs in the same pod as its rollout service). Triton compiles small
# helpers at run time, hence gcc; bubblewrap jails local tool calls, git serves the SWE environment.
#
# Build (see images/README.md):
#   docker build -f images/vllm.Dockerfile -t ghcr.io/sao-kfp/sao-kfp-vllm:0.1.0 .
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG PIP_CERT=
ENV PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false \
    SAO_CACHE_DIR=/var/cache/sao VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    NCCL_DEBUG=WARN VLLM_WORKER_MULTIPROC_METHOD=spawn
RUN set -eu; \
    packages="bubblewrap git ca-certificates gcc libc6-dev"; \
    python3 -c "import venv, ensurepip" 2>/dev/null || packages="$packages python3 python3-venv python3-dev"; \
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
    pip install --no-cache-dir --upgrade pip; \
    pip install --no-cache-dir "torch==2.13.0" "vllm==0.32.0"; \
    pip install --no-cache-dir ".[train,serve]"; \
    pip install --no-cache-dir --no-deps "swebench==5.0.2"; \
    python -c "import torch, vllm; assert torch.version.cuda and torch.__version__.startswith('2.13.0'), torch.__version__"; \
    sao --quiet build-model
ENTRYPOINT ["sao"]
CMD ["--help"]
