"""SFT: cross-entropy on the assistant tokens of chat conversations."""

from __future__ import annotations

from sao_core.models.loading import pad_token_id
from sao_core.objectives.sft import sft_loss
from sao_core.training.chat_batch import encode_chat, pad_batch
from sao_core.training.forward import model_logprobs
from sao_core.training.methods.base import Method, row_error, row_messages


def token_nll(model, batch, pad_id: int, device):
    """SFT/CPT loss of a micro-batch of `EncodedChat` examples: (loss, metrics)."""
    tensors = {k: v.to(device) for k, v in pad_batch(batch, pad_id).items()}
    logp, _ = model_logprobs(model, tensors["input_ids"], tensors["attention_mask"], positions=tensors["loss_mask"])
    return sft_loss(logp, tensors["loss_mask"])


class SFTMethod(Method):
    name = "sft"
    dataset_kind = "sft"

    def build_examples(self, rows, source):
        examples = []
        for index, row in enumerate(rows):
            messages = row_messages(row, source, index)
            try:
                examples.append(encode_chat(self.tokenizer, messages, self.config.max_tokens))
            except ValueError as err:
                raise row_error(source, index, str(err)) from err
        return examples

    def loss(self, model, batch, step, training=True, micro=0):
        return token_nll(model, batch, pad_token_id(self.tokenizer), self.ctx.device)
