"""CPT: next-token loss on raw text, packed into blocks of `max_tokens` tokens."""

from __future__ import annotations

from sao_core.models.loading import pad_token_id
from sao_core.training.chat_batch import EncodedChat
from sao_core.training.methods.base import Method, row_error
from sao_core.training.methods.sft import token_nll


class CPTMethod(Method):
    name = "cpt"
    dataset_kind = "cpt"

    def build_examples(self, rows, source):
        """Texts joined with the end-of-text token and cut into blocks; the last short block is kept
        when it has at least two tokens (one prediction)."""
        separator = self.tokenizer.eos_token_id
        stream: list[int] = []
        for index, row in enumerate(rows):
            text = row.get("text")
            if not isinstance(text, str) or not text:
                raise row_error(source, index, "no non-empty 'text' (prepare the data with --kind cpt)")
            stream.extend(self.tokenizer.encode(text, add_special_tokens=False))
            stream.append(separator)
        block = self.config.max_tokens
        blocks = [stream[i:i + block] for i in range(0, len(stream), block)]
        return [EncodedChat(ids, [0] + [1] * (len(ids) - 1)) for ids in blocks if len(ids) >= 2]

    def loss(self, model, batch, step, training=True, micro=0):
        return token_nll(model, batch, pad_token_id(self.tokenizer), self.ctx.device)
