"""DPO: sigmoid preference loss against reference log-probs computed once before training."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sao_core.models.loading import pad_token_id
from sao_core.objectives.dpo import dpo_loss, sequence_logprobs
from sao_core.training.chat_batch import EncodedChat, as_messages, encode_response
from sao_core.training.methods.base import Method, batch_logprobs


@dataclass
class DPOExample:
    chosen: EncodedChat
    rejected: EncodedChat
    ref_chosen: float = 0.0     # summed reference log-prob of the chosen response
    ref_rejected: float = 0.0


class DPOMethod(Method):
    name = "dpo"
    dataset_kind = "dpo"

    def build_example(self, row):
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (prepare the data with --kind dpo)")
        prompt = as_messages(row["prompt"], "user")
        chosen = encode_response(self.tokenizer, prompt, as_messages(row["chosen"], "assistant"), self.config.max_tokens)
        rejected = encode_response(self.tokenizer, prompt, as_messages(row["rejected"], "assistant"),
                                   self.config.max_tokens)
        return DPOExample(chosen, rejected)

    def _sequence_logprobs(self, model, encoded: list[EncodedChat]) -> torch.Tensor:
        return sequence_logprobs(*batch_logprobs(model, encoded, pad_token_id(self.tokenizer), self.ctx.device))

    def setup(self, model, examples):
        """Reference log-probs for every example, once (the reference is the initial policy unless
        `reference_model` names another model)."""
        reference = model
        if self.config.reference_model:
            from sao_core.models import load_model

            reference = load_model(self.config.reference_model, self.config.cache_dir,
                                   unverified=self.config.unverified).to(self.ctx.device)
        was_training = reference.training
        reference.eval()
        size = self.config.batch_size
        with torch.no_grad():
            for start in range(0, len(examples), size):
                chunk = examples[start:start + size]
                values = self._sequence_logprobs(reference, [e.chosen for e in chunk] + [e.rejected for e in chunk])
                for i, example in enumerate(chunk):
                    example.ref_chosen = float(values[i])
                    example.ref_rejected = float(values[len(chunk) + i])
        reference.train(was_training)

    def loss(self, model, batch, step, training=True, micro=0):
        values = self._sequence_logprobs(model, [e.chosen for e in batch] + [e.rejected for e in batch])
        n = len(batch)
        ref = torch.tensor([[e.ref_chosen, e.ref_rejected] for e in batch], device=values.device)
        return dpo_loss(values[:n], values[n:], ref[:, 0], ref[:, 1], beta=self.config.beta)
