"""The one place container image names come from.

Three images (see images/README.md): ``cpu`` (data preparation, reports, small CPU runs), ``train``
(CUDA torch for SFT / CPT / DPO / GKD) and ``rollout`` (vLLM on CUDA plus the training core: rollout
services, the colocated RL learner, evaluation). Each resolves to ``REGISTRY/sao-kfp-KIND:TAG``;
override with environment variables, read when a component or pipeline is defined (so set them before
importing ``components``/``pipelines``, or pass ``--image-*`` to ``sao kfp compile``, which does):

- ``SAO_IMAGE_REGISTRY`` (default ``ghcr.io/sao-kfp``), ``SAO_IMAGE_TAG`` (default: the package version);
- ``SAO_IMAGE_CPU``, ``SAO_IMAGE_TRAIN``, ``SAO_IMAGE_ROLLOUT``: a full reference for one image.
"""

from __future__ import annotations

import os
from importlib import metadata

KINDS = ("cpu", "train", "rollout")
DEFAULT_REGISTRY = "ghcr.io/sao-kfp"
#: Image name (without registry and tag) of each kind; Dockerfile images/<dockerfile> builds it.
NAMES = {"cpu": "sao-kfp-cpu", "train": "sao-kfp-cuda", "rollout": "sao-kfp-vllm"}
DOCKERFILES = {"cpu": "images/cpu.Dockerfile", "train": "images/cuda.Dockerfile", "rollout": "images/vllm.Dockerfile"}


def package_version() -> str:
    """Version of the installed sao-kfp distribution (the default image tag)."""
    try:
        return metadata.version("sao-kfp")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def image(kind: str) -> str:
    """Full image reference of `kind` (cpu | train | rollout), honouring the SAO_IMAGE_* overrides."""
    if kind not in KINDS:
        raise ValueError(f"unknown image kind {kind!r}; choose one of {', '.join(KINDS)}")
    override = os.environ.get(f"SAO_IMAGE_{kind.upper()}", "").strip()
    if override:
        return override
    registry = os.environ.get("SAO_IMAGE_REGISTRY", "").strip().rstrip("/") or DEFAULT_REGISTRY
    tag = os.environ.get("SAO_IMAGE_TAG", "").strip() or package_version()
    return f"{registry}/{NAMES[kind]}:{tag}"


def all_images() -> dict[str, str]:
    """{kind: reference} for every image kind."""
    return {kind: image(kind) for kind in KINDS}
