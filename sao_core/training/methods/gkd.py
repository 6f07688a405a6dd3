"""GKD: distil a teacher into the student with the generalised JSD, on a mix of dataset responses and
responses the student samples itself (on-policy share λ)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sao_core.models.loading import pad_token_id
from sao_core.training.chat_batch import EncodedChat, encode_response
from sao_core.training.forward import model_distillation_divergence
from sao_core.training.methods.base import Method, padded_batch, row_messages
from sao_core.training.sampling import sample_continuations


@dataclass
class GKDExample:
    prompt_ids: list[int]     # the prompt rendered with the generation prompt
    offline: EncodedChat      # prompt + the dataset's response


class GKDMethod(Method):
    name = "gkd"
    dataset_kind = "sft"

    def build_example(self, row):
        messages = row_messages(row)
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is None or last == 0:
            raise ValueError("needs a prompt followed by an assistant response")
        prompt = messages[:last]
        offline = encode_response(self.tokenizer, prompt, [messages[last]], self.config.max_tokens)
        prompt_ids = self.tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                        return_dict=True)["input_ids"]
        return GKDExample(list(prompt_ids), offline)

    def setup(self, model, examples):
        from sao_core.models import load_model_and_tokenizer

        teacher, teacher_tokenizer = load_model_and_tokenizer(self.config.teacher_model, self.config.cache_dir,
                                                             unverified=self.config.unverified)
        if teacher_tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"teacher {self.config.teacher_model!r} and student {self.config.model!r} use "
                             "different tokenizers; GKD needs one shared vocabulary")
        self.teacher = teacher.to(self.ctx.device).eval().requires_grad_(False)

    def _on_policy(self, step: int, micro: int) -> bool:
        # One decision per micro-batch, identical on every rank (ranks must sample in lock-step).
        g = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step * 1_009 + micro)
        return bool(torch.rand((), generator=g) < self.config.on_policy_fraction)

    def loss(self, model, batch, step, training=True, micro=0):
        if training and self._on_policy(step, micro):
            g = torch.Generator().manual_seed(self.config.seed * 7_919 + step * 104_729 + micro * 31 + self.ctx.rank)
            sampled = sample_continuations(model, [e.prompt_ids for e in batch], self.config.max_new_tokens,
                                           self.config.temperature, pad_token_id(self.tokenizer),
                                           self.tokenizer.eos_token_id, g, self.ctx.device)
            encoded = [EncodedChat(e.prompt_ids + s, [0] * len(e.prompt_ids) + [1] * len(s))
                       for e, s in zip(batch, sampled, strict=True) if s]
        else:
            encoded = [e.offline for e in batch]
        tensors = padded_batch(encoded, pad_token_id(self.tokenizer), self.ctx.device)
        # Logits at position t predict token t + 1: learn where the next token is a response token.
        mask = torch.zeros_like(tensors["loss_mask"])
        mask[:, :-1] = tensors["loss_mask"][:, 1:]
        # The generalised JSD of `objectives.gkd`, applied chunk by chunk to the two output layers.
        total, count = model_distillation_divergence(model, self.teacher, tensors["input_ids"],
                                                     tensors["attention_mask"], mask, self.config.beta,
                                                     self.config.temperature)
        loss = total / max(count, 1)
        return loss, {"loss": float(loss.detach()), "tokens": float(count)}
