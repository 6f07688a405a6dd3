"""One typed config dataclass per training method; all share `TrainConfig`.

Steps count optimiser updates. `batch_size` is the number of examples in one optimiser step over all
ranks; each rank takes `batch_size / world_size` of them in `grad_accum` micro-batches. Lengths are in
tokens. Load from YAML and override from the CLI with `sao_core.config.load_config`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sao_core.config import check_finite, setting
from sao_core.training.schedule import SCHEDULES

Precision = Literal["auto", "float32", "bf16"]
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)
Schedule = Literal["constant", "cosine", "linear"]
assert typing.get_args(Schedule) == SCHEDULES


@dataclass
class CoreConfig:
    """Settings of the shared training core, used by every method (sft, cpt, dpo, gkd and the RL learner):
    model, schedule, optimiser, precision, memory and checkpoint settings. One place defines them."""

    data: str = setting(help="prepared dataset: directory (or s3:// prefix) holding data.jsonl",
                        section="model_and_data")
    output: str = setting(help="run directory: local path or s3:// prefix", section="model_and_data")
    model: str = setting("embedded:tiny", "model reference: embedded:*, directory, s3:// or hub id",
                         section="model_and_data")
    steps: int = setting(100, "optimiser steps (RL: learner steps) in total", unit="steps",
                         section="optimisation")
    schedule: Schedule = setting("constant", "learning-rate schedule after the warm-up: constant, cosine or linear",
                                 section="optimisation")
    warmup_steps: int = setting(0, "linear lr warm-up", unit="optimiser updates", section="optimisation")
    min_lr_ratio: float = setting(0.0, "final lr as a share of lr (cosine, linear)", section="optimisation")
    weight_decay: float = setting(0.0, "AdamW weight decay", section="optimisation")
    grad_clip: float = setting(1.0, "max global grad norm; 0 disables", section="optimisation")
    precision: Precision = setting("auto", "auto (bf16 on GPU, float32 on CPU), float32 or bf16 (autocast; master "
                                   "weights and optimiser float32)", section="optimisation")
    gradient_checkpointing: bool = setting(False, "recompute decoder-layer activations in the backward pass",
                                           section="optimisation")
    checkpoint_every: int = setting(0, "steps between resumable checkpoints; 0: only at the end", unit="steps",
                                    section="checkpoints")
    keep_checkpoints: int = setting(3, "resumable checkpoints kept: the newest N complete ones (an older one is "
                                    "deleted once a newer one is complete); 0: all", unit="checkpoints",
                                    section="checkpoints")
    pin_checkpoints: tuple[int, ...] = setting((), "steps whose checkpoints are never deleted, e.g. 100,200",
                                               unit="steps", section="checkpoints")
    resume: bool = setting(False, "continue from the newest complete checkpoint in output",
                           section="checkpoints")
    log_every: int = setting(10, "steps between metrics lines (and progress updates)", unit="steps",
                             section="checkpoints")
    report_every: int = setting(25, "steps between refreshes of <output>/training_report.html; 0: only at the end",
                                unit="steps", section="checkpoints")
    seed: int = setting(0, "random seed of the run (initialisation, shuffling, sampling)",
                        section="model_and_data")
    cache_dir: str = setting(factory=lambda: str(Path.home() / ".cache" / "sao"),
                             help="where built and downloaded models live ($SAO_CACHE_DIR, else ~/.cache/sao)",
                             section="model_and_data")
    unverified: bool = setting(False, "load a local model folder without a manifest.json as it is",
                               section="model_and_data")
    # LoRA (sao_core/training/lora.py, peft): only an adapter trains (RL: the policy's; the critic trains fully);
    # the exported and published models have it merged in.
    lora_rank: int = setting(0, "LoRA adapter rank; 0: train every weight (full fine-tuning)", section="lora")
    lora_alpha: float = setting(16.0, "LoRA scale numerator (the adapter's update is scaled by alpha / rank)",
                                section="lora")
    lora_dropout: float = setting(0.0, "dropout on the LoRA adapter's input", section="lora")
    lora_target_modules: str = setting("", "modules that get an adapter: '' peft's default for the architecture, "
                                       "all-linear, or comma-separated names (q_proj,v_proj)", section="lora")

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        check_finite(self)  # no inf / nan in any float field (eps_high=inf, lr=nan, ...)
        name = type(self).__name__
        for key in ("steps", "log_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"{name}.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("warmup_steps", "checkpoint_every", "keep_checkpoints", "report_every", "grad_clip",
                    "weight_decay"):
            if getattr(self, key) < 0:
                raise ValueError(f"{name}.{key} must be >= 0, got {getattr(self, key)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{name}.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"{name}.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.lora_rank < 0:
            raise ValueError(f"{name}.lora_rank must be >= 0 (0: no LoRA), got {self.lora_rank}")
        if self.lora_rank and not self.lora_alpha > 0:
            raise ValueError(f"{name}.lora_alpha must be > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"{name}.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"{name}.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


@dataclass
class TrainConfig(CoreConfig):
    """Settings every supervised method shares (the core's, plus batch, lr and length)."""

    schedule: Schedule = setting("cosine", "learning-rate schedule after the warm-up: constant, cosine or linear",
                                 section="optimisation")
    warmup_steps: int = setting(10, "linear lr warm-up", unit="optimiser updates", section="optimisation")
    batch_size: int = setting(16, "examples per optimiser step, over all ranks", unit="examples",
                              section="optimisation")
    grad_accum: int = setting(1, "micro-batches per optimiser step on each rank", section="optimisation")
    lr: float = setting(1e-5, "learning rate (peak, after the warm-up)", section="optimisation")
    max_tokens: int = setting(512, "examples are cut (or packed) to this many tokens", unit="tokens",
                              section="optimisation")

    def validate(self) -> None:
        super().validate()
        name = type(self).__name__
        for key in ("batch_size", "grad_accum", "max_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{name}.{key} must be >= 1, got {getattr(self, key)}")
        if not self.lr > 0:
            raise ValueError(f"{name}.lr must be > 0, got {self.lr}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"{name}.batch_size ({self.batch_size}) must be a multiple of grad_accum "
                             f"({self.grad_accum})")



@dataclass
class SFTConfig(TrainConfig):
    """Supervised fine-tuning on chat messages: cross-entropy on assistant tokens only."""


@dataclass
class CPTConfig(TrainConfig):
    """Continued pre-training: next-token loss on raw text packed into blocks of `max_tokens`."""


@dataclass
class DPOConfig(TrainConfig):
    """Direct preference optimisation (sigmoid loss)."""

    beta: float = setting(0.1, "strength of the implicit KL constraint", section="dpo")
    reference_model: str = setting("", "reference model; empty: the initial policy (`model`)", section="dpo")

    def validate(self) -> None:
        super().validate()
        if not self.beta > 0:
            raise ValueError(f"DPOConfig.beta must be > 0, got {self.beta}")


@dataclass
class GKDConfig(TrainConfig):
    """Generalised knowledge distillation from a teacher sharing the student's tokenizer."""

    teacher_model: str = setting("", "model reference of the teacher (required)", section="gkd")
    beta: float = setting(0.5, "divergence: 0 forward KL, 1 reverse KL, between: generalised JSD",
                          section="gkd")
    temperature: float = setting(1.0, "softmax temperature of the distillation", section="gkd")
    on_policy_fraction: float = setting(0.5, "share of examples whose response the student samples",
                                        section="gkd")
    max_new_tokens: int = setting(64, "length of student samples", unit="tokens", section="gkd")

    def validate(self) -> None:
        super().validate()
        if not self.teacher_model:
            raise ValueError("GKDConfig.teacher_model is required (a model reference)")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"GKDConfig.beta must be in [0, 1], got {self.beta}")
        if not self.temperature > 0:
            raise ValueError(f"GKDConfig.temperature must be > 0, got {self.temperature}")
        if not 0.0 <= self.on_policy_fraction <= 1.0:
            raise ValueError(f"GKDConfig.on_policy_fraction must be in [0, 1], got {self.on_policy_fraction}")
        if self.max_new_tokens < 1:
            raise ValueError(f"GKDConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")


METHOD_CONFIGS: dict[str, type[TrainConfig]] = {
    "sft": SFTConfig,
    "cpt": CPTConfig,
    "dpo": DPOConfig,
    "gkd": GKDConfig,
}
