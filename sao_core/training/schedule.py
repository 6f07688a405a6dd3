"""Learning-rate schedules with linear warm-up."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(step: int, total_steps: int, warmup_steps: int = 0, schedule: str = "constant",
              min_factor: float = 0.0) -> float:
    """Multiplier of the base learning rate at optimiser step `step` (0-based).

    Warm-up rises linearly from 1/(warmup_steps) to 1 over `warmup_steps` steps; afterwards `constant`
    stays at 1, `linear` and `cosine` decay to `min_factor` at `total_steps`.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        return 1.0 - (1.0 - min_factor) * progress
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
