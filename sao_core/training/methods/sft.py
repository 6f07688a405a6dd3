"""SFT: cross-entropy on the assistant tokens of chat conversations."""

from __future__ import annotations

from sao_core.models.loading import pad_token_id
from sao_core.objectives.sft import sft_loss
from sao_core.training.chat_batch import encode_chat
from sao_core.training.methods.base import Method, batch_logprobs, row_messages


def token_nll(model, batch, pad_id: int, device):
    """SFT/CPT loss of a micro-batch of `EncodedChat` examples: (loss, metrics)."""
    return sft_loss(*batch_logprobs(model, batch, pad_id, device))


class SFTMethod(Method):
    name = "sft"
    dataset_kind = "sft"

    def build_example(self, row):
        return encode_chat(self.tokenizer, row_messages(row), self.config.max_tokens)

    def loss(self, model, batch, step, training=True, micro=0):
        return token_nll(model, batch, pad_token_id(self.tokenizer), self.ctx.device)
