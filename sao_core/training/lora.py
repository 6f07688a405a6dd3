"""LoRA adapters on the training core, with the `peft` library (wrapped, not re-implemented).

`apply_lora` wraps a causal LM in a peft LoRA model: only the adapter's weights train (the optimiser is built
over the parameters that require a gradient, so it holds the adapter's states only). Checkpoints keep the whole
wrapped model's state (the training core's format), so a resume is exact. `plain_state_dict` gives the weights
of the model with the adapter merged in (peft's own merge), under the base model's names: what an export
writes, a Hugging Face model any engine loads without peft.

Scope of this first part (issue 29): the supervised methods (sft, cpt, dpo, gkd) in one process. Not yet:
FSDP2 under torchrun, the RL learner and its push to the rollout engines, adapter-only checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch

#: peft's prefix of the base model's parameter names inside a PeftModel
_PEFT_PREFIX = "base_model.model."


def lora_config(rank: int, alpha: float, dropout: float, target_modules: str):
    """peft's LoraConfig for a causal LM. `target_modules`: "" for peft's default for the model's architecture,
    "all-linear" for every linear layer but the output head, or comma-separated module names."""
    from peft import LoraConfig

    targets: Any = None
    if target_modules.strip() == "all-linear":
        targets = "all-linear"
    elif target_modules.strip():
        targets = [name.strip() for name in target_modules.split(",") if name.strip()]
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM")


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float, target_modules: str):
    """`model` wrapped with a new LoRA adapter (its B matrices start at zero, so the wrapped model computes what
    `model` did); ValueError naming the setting when peft refuses the target modules."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(rank, alpha, dropout, target_modules))
    except ValueError as err:
        raise ValueError(f"lora_target_modules {target_modules!r}: {err}") from None


def apply_lora_settings(model: torch.nn.Module, config, distributed: bool):
    """`model` with the LoRA adapter of a training-core config (`lora_rank` 0: `model` unchanged), and a summary
    (rank, alpha, targets, trainable / all parameters; None without LoRA). ValueError naming the setting when
    LoRA cannot run: under torchrun (FSDP2 with an adapter is not supported yet) or bad target modules."""
    if not config.lora_rank:
        return model, None
    if distributed:
        raise ValueError("lora_rank > 0 under torchrun (FSDP2) is not supported yet: run LoRA in one process")
    model = apply_lora(model, config.lora_rank, config.lora_alpha, config.lora_dropout, config.lora_target_modules)
    trained, total = trainable_parameters(model)
    return model, {"rank": config.lora_rank, "alpha": config.lora_alpha,
                   "target_modules": config.lora_target_modules or "(peft default)",
                   "trainable_parameters": trained, "parameters": total}


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters that train, all parameters)."""
    return (sum(p.numel() for p in model.parameters() if p.requires_grad),
            sum(p.numel() for p in model.parameters()))


def plain_state_dict(model: torch.nn.Module, state_dict_fn) -> dict[str, torch.Tensor]:
    """The model's full weights under the base model's names, the adapter merged in by peft for a LoRA model.
    `state_dict_fn(model)` gathers the full state dict (the training core's, FSDP-aware). The live model is
    left as it was (merged only for the copy)."""
    if not is_lora(model):
        return state_dict_fn(model)
    model.merge_adapter()
    try:
        full = {k: v.detach().clone() for k, v in state_dict_fn(model).items()}
    finally:
        model.unmerge_adapter()
    plain = {}
    for name, tensor in full.items():
        if ".lora_" in name:
            continue
        plain[name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")] = tensor
    return plain
