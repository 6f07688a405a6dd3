"""The shared training core's parts: model set-up, precision, optimiser, schedule and the optimiser step.

Every method uses these, the supervised trainer (`trainer.py`) and the RL learner (`learner/updates.py`,
for the policy and for the critic), so precision, FSDP2 wrapping, activation checkpointing, clipping and
schedules behave the same everywhere.

Precision. Master weights and optimiser state stay float32. `bf16` runs the forward and backward passes
under `torch.autocast(dtype=bfloat16)` (matmuls in bf16, reductions and norms in float32) on GPU and on
CPU; `auto` means bf16 on a CUDA device that supports it and float32 elsewhere. Log-probs, ratios and
losses are float32 in every mode (`objectives.chunked` upcasts each chunk of logits before the
log-sum-exp). Under torchrun the same autocast region wraps the FSDP2-sharded model.
"""

from __future__ import annotations

import contextlib

import torch

from sao_core.training.config import PRECISIONS, CoreConfig
from sao_core.training.distributed import DistContext, shard_model
from sao_core.training.schedule import lr_factor


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of `precision` on `device`, or None for plain float32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The region in which forward (and loss) computations run: a bf16 autocast or nothing."""
    dtype = autocast_dtype(precision, device)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def prepare_model(model: torch.nn.Module, ctx: DistContext, gradient_checkpointing: bool) -> torch.nn.Module:
    """Move a model (causal LM or critic) to the rank's device in float32, enable activation checkpointing if
    asked, then shard it with FSDP2 under torchrun. Returns the model to train."""
    model = model.to(device=ctx.device, dtype=torch.float32)
    if gradient_checkpointing:
        # use_reentrant=False: works with frozen parameters (the critic's attention) and with FSDP2.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        config = getattr(model, "config", None)
        if config is not None:
            config.use_cache = False
    return shard_model(model, ctx)


def build_optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the parameters that require a gradient."""
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, weight_decay=weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, config: CoreConfig, total_updates: int
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """The config's schedule (with warm-up) over `total_updates` optimiser updates; step it once per update."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, max(1, total_updates), config.warmup_steps, config.schedule,
                                       config.min_lr_ratio))


def clip_and_step(optimizer: torch.optim.Optimizer, params, clip: float,
                  scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> float:
    """Clip the global gradient norm (0: no clipping), step the optimiser and the schedule, clear the
    gradients; returns the norm before clipping. `params` are listed after the backward passes: FSDP2 swaps
    a module's parameters between sharded and unsharded tensors around forward."""
    params = [p for p in params if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, clip or float("inf"))
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    # FSDP2 parameters are DTensors; their norm is a DTensor of the global norm.
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
