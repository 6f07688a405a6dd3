"""The one maker of test LoRA adapters: peft on a model folder, B matrices drawn as if trained (they start at
zero), written in peft's format with `write_adapter`."""

from __future__ import annotations

from pathlib import Path

import torch

from sao_core.models import load_model
from sao_core.training.lora import adapter_state_dict, apply_lora, write_adapter


def make_adapter(model_dir, cache, out: Path | str, seed: int = 0, rank: int = 4,
                 target_modules: str = "q_proj,v_proj"):
    """Write an adapter of `rank` on `target_modules` of the model at `model_dir` to `out`; return the peft model
    (in eval mode), the reference the engines and the merge are checked against."""
    model = apply_lora(load_model(str(model_dir), str(cache)), rank=rank, alpha=8.0, dropout=0.0,
                       target_modules=target_modules)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:    # B starts at zero: a trained adapter has moved it
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    write_adapter(model, adapter_state_dict(model, lambda m: m.state_dict()), out)
    return model.eval()


def move_lora_b(model: torch.nn.Module, seed: int, scale: float = 0.02) -> None:
    """Add `scale` times seeded normal noise to every LoRA B matrix of `model`, as training would move them: the
    embedded model earns no reward in a few steps, so its gradients are zero and an adapter would stay the base's.
    The same `seed` (a step) moves them the same way, also on a replayed step."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(scale * torch.randn(param.shape, generator=generator))
