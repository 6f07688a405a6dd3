# CPU image for the SAO components (data preparation, evaluation, small CPU runs, the KFP local demo).
# Build:  buildah bud --isolation chroot -f images/cpu.Dockerfile -t sao-kfp:cpu .
# The torch CPU wheel comes from PyTorch's CPU index; a plain `torch==2.13.0` from PyPI is the CUDA build.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG PIP_CERT=
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE HF_HUB_DISABLE_TELEMETRY=1
WORKDIR /opt/sao
COPY pyproject.toml README.md ./
COPY sao_core ./sao_core
COPY components ./components
COPY pipelines ./pipelines
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" "torch==2.13.0" \
 && pip install --no-cache-dir ".[train]"
ENTRYPOINT ["sao"]
