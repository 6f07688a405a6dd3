"""Inference engines behind one interface: `hf` (transformers, the embedded default) and `vllm`."""

from sao_core.rollout.engines.base import (
    Engine,
    EngineError,
    Generation,
    SamplingParams,
    check_context,
    check_training_sampling,
)

__all__ = ["Engine", "EngineError", "Generation", "SamplingParams", "check_context", "check_training_sampling",
           "make_engine"]


def make_engine(kind: str, model: str, cache_dir: str, **options) -> Engine:
    """Create an engine: kind "hf" or "vllm"; `model` is a model reference (see sao_core.models)."""
    if kind == "hf":
        from sao_core.rollout.engines.hf import HFEngine

        return HFEngine(model, cache_dir, **options)
    if kind == "vllm":
        from sao_core.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(model, cache_dir, **options)
    raise EngineError(f"unknown engine {kind!r}; choose hf or vllm")
