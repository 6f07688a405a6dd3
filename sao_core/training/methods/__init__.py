"""Training methods on the shared core. Each turns prepared rows into examples and computes a loss."""

from __future__ import annotations

from sao_core.training.methods.base import Method
from sao_core.training.methods.cpt import CPTMethod
from sao_core.training.methods.dpo import DPOMethod
from sao_core.training.methods.gkd import GKDMethod
from sao_core.training.methods.sft import SFTMethod

METHODS: dict[str, type[Method]] = {
    "sft": SFTMethod,
    "cpt": CPTMethod,
    "dpo": DPOMethod,
    "gkd": GKDMethod,
}

__all__ = ["METHODS", "Method"]
