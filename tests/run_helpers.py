"""Helpers shared by the training and learner tests."""

from __future__ import annotations


class StopRun(Exception):
    """Raised by `stop_at`'s callback: a run that fails right after a given step."""


def stop_at(step: int):
    """A `progress(step, record)` callback for train() / train_rl() that raises StopRun right after `step`
    (its metrics line written, its weights published, its batch journaled)."""
    def progress(current: int, record: dict) -> None:
        if current == step:
            raise StopRun(f"stopped after step {step}")

    return progress
