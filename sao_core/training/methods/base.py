"""The contract between the trainer and a method."""

from __future__ import annotations

from typing import Any

import torch

from sao_core.training.chat_batch import EncodedChat, pad_batch
from sao_core.training.config import TrainConfig
from sao_core.training.distributed import DistContext
from sao_core.training.forward import model_logprobs


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
        """Tokenise rows, one `build_example` each; raise ValueError naming `source` and the row index for a row
        it cannot use."""
        examples = []
        for index, row in enumerate(rows):
            try:
                examples.append(self.build_example(row))
            except ValueError as err:
                raise row_error(source, index, str(err)) from err
        return examples

    def build_example(self, row: dict) -> Any:
        """The example of one prepared row; ValueError saying what is wrong with a row it cannot use."""
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


def row_messages(row: dict) -> list[dict]:
    """The `messages` of a prepared sft row; ValueError otherwise."""
    messages = row.get("messages")
    if not isinstance(messages, list):
        raise ValueError("no 'messages' list (prepare the data with --kind sft)")
    return messages


def padded_batch(encoded: list[EncodedChat], pad_id: int, device) -> dict[str, torch.Tensor]:
    """`encoded` right-padded into one batch on `device`: input_ids, attention_mask, loss_mask, each [B, T]."""
    return {k: v.to(device) for k, v in pad_batch(encoded, pad_id).items()}


def batch_logprobs(model, encoded: list[EncodedChat], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [B, T] of the tokens of `encoded` under `model`, computed on the loss positions only, and the
    loss mask [B, T]) of the padded batch on `device`."""
    tensors = padded_batch(encoded, pad_id, device)
    logp, _ = model_logprobs(model, tensors["input_ids"], tensors["attention_mask"], positions=tensors["loss_mask"])
    return logp, tensors["loss_mask"]
