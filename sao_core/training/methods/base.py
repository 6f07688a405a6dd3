"""The contract between the trainer and a method."""

from __future__ import annotations

from typing import Any

import torch

from sao_core.training.config import TrainConfig
from sao_core.training.distributed import DistContext


class Method:
    """A post-training method: examples from prepared rows, and a loss on a micro-batch of them.

    `dataset_kind` is the `sao prepare-data --kind` the method consumes; the trainer refuses data of
    another kind before training starts.
    """

    name = ""
    dataset_kind = ""

    def __init__(self, config: TrainConfig, tokenizer, ctx: DistContext):
        self.config = config
        self.tokenizer = tokenizer
        self.ctx = ctx

    def build_examples(self, rows: list[dict], source: str) -> list[Any]:
        """Tokenise rows; raise ValueError naming `source` and the row index for a row it cannot use."""
        raise NotImplementedError

    def setup(self, model: torch.nn.Module, examples: list[Any]) -> None:
        """One-off work before training (e.g. reference log-probs); `model` is the initial policy."""

    def loss(self, model: torch.nn.Module, batch: list[Any], step: int, training: bool = True, micro: int = 0
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss (mean over the micro-batch) and float metrics; `micro` is the micro-batch index
        within the optimiser step; `training` False means evaluation (no sampling)."""
        raise NotImplementedError


def row_error(source: str, index: int, message: str) -> ValueError:
    return ValueError(f"{source}: row {index}: {message}")


def row_messages(row: dict, source: str, index: int) -> list[dict]:
    """The `messages` of a prepared sft row; ValueError naming the row otherwise."""
    messages = row.get("messages")
    if not isinstance(messages, list):
        raise row_error(source, index, "no 'messages' list (prepare the data with --kind sft)")
    return messages
