"""The pipelines: ``post_training`` (method picked in the UI), ``sao_rl`` (the SAO path end to end) and
``evaluation`` (benchmarks in parallel; the target of recurring runs).

Each module has a ``build_*(settings)`` factory taking the compile-time Kubernetes settings
(:class:`sao_core.kfp.k8s.ClusterSettings`), a default-built pipeline, its KFP ``NAME`` and the
``LITERALS`` (dropdowns) patched into the compiled spec. :func:`build` and :data:`PIPELINES` are the
registry the ``sao kfp`` commands use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from pipelines import _kfp_merge

_kfp_merge.install()  # kfp 2.17's sub-pipeline merge is order-dependent and loses Kubernetes configs

#: Pipeline name -> module under pipelines/.
PIPELINES = {"post_training": "pipelines.post_training", "sao_rl": "pipelines.sao_rl",
             "evaluation": "pipelines.evaluation"}


@dataclass(frozen=True)
class BuiltPipeline:
    """A pipeline function with its KFP name and dropdown literals."""

    name: str
    kfp_name: str
    func: Any
    literals: dict[str, list]


def build(name: str, settings=None) -> BuiltPipeline:
    """Build pipeline `name` (post_training | sao_rl | evaluation) with compile-time `settings`."""
    if name not in PIPELINES:
        raise ValueError(f"unknown pipeline {name!r}; choose one of {', '.join(PIPELINES)}")
    module = importlib.import_module(PIPELINES[name])
    func = getattr(module, f"build_{name}")(settings)
    return BuiltPipeline(name=name, kfp_name=module.NAME, func=func, literals=dict(module.LITERALS))
