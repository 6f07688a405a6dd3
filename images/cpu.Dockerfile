# CPU image of the SAO components: data preparation, argument checks, reports, small CPU runs on the
# embedded model (HF engine), the KFP local demo. Components run `python3 -m kfp.dsl.executor_main`
# from /opt/venv (install_kfp_package=False: kfp comes with this package).
#
# Build (see images/README.md):
#   docker build -f images/cpu.Dockerfile -t ghcr.io/sao-kfp/sao-kfp-cpu:0.1.0 .
#   buildah bud --isolation chroot -f images/cpu.Dockerfile -t ghcr.io/sao-kfp/sao-kfp-cpu:0.1.0 .
# A plain `torch==2.13.0` from PyPI is the multi-GB CUDA build, so torch comes from PyTorch's CPU index
# (TORCH_INDEX) or from a folder of wheels mounted into the build (PIP_FIND_LINKS).
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG PIP_CERT=
ARG PIP_FIND_LINKS=
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false \
    SAO_CACHE_DIR=/var/cache/sao VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# python3 + venv when the base has none (a Debian base); bubblewrap jails the local tool sandbox, git
# serves the SWE environment.
RUN set -eu; \
    packages="bubblewrap git ca-certificates"; \
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
    links=""; if [ -n "$PIP_FIND_LINKS" ]; then links="--find-links $PIP_FIND_LINKS"; fi; \
    index=""; if [ -n "$TORCH_INDEX" ]; then index="--extra-index-url $TORCH_INDEX"; fi; \
    pip install --no-cache-dir --upgrade pip; \
    pip install --no-cache-dir $links $index "torch==2.13.0"; \
    pip install --no-cache-dir $links ".[train]"; \
    pip install --no-cache-dir $links --no-deps "swebench==5.0.2"; \
    python -c "import torch; assert not torch.version.cuda, 'the CPU image got a CUDA torch'"; \
    sao --quiet build-model
ENTRYPOINT ["sao"]
CMD ["--help"]
