"""Turn chat conversations into token ids with a loss mask, and pad them into batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EncodedChat:
    """One conversation as tokens: `loss_mask[t]` is 1 where token t was produced by the assistant."""

    input_ids: list[int]
    loss_mask: list[int]


def encode_chat(tokenizer, messages: list[dict], max_tokens: int) -> EncodedChat:
    """Render `messages` with the tokenizer's chat template; mask = assistant tokens; cut to `max_tokens`.

    Raises ValueError when the template does not mark assistant tokens ({% generation %} blocks) or when
    no assistant token survives the cut.
    """
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = list(out["input_ids"])[:max_tokens]
    mask = list(out["assistant_masks"])[:max_tokens]
    if not any(mask):
        raise ValueError(
            "no assistant tokens to learn in this conversation (after cutting to "
            f"{max_tokens} tokens, or the chat template has no {{% generation %}} block)"
        )
    return EncodedChat(ids, mask)


def pad_batch(examples: list[EncodedChat], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: input_ids, attention_mask, loss_mask, each [B, T] long."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        attention[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(e.loss_mask)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def as_messages(value, role: str) -> list[dict]:
    """A string becomes one message of `role`; a list of messages is returned as it is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return value
    raise ValueError(f"expected a string or a list of messages, got {type(value).__name__}")


def encode_response(tokenizer, prompt: list[dict], response: list[dict], max_tokens: int) -> EncodedChat:
    """Encode prompt + response; only assistant tokens of the response are learned (prompt turns are
    masked even when they hold assistant messages)."""
    full = encode_chat(tokenizer, prompt + response, max_tokens)
    prompt_len = len(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                   return_dict=True)["input_ids"])
    mask = [0 if i < prompt_len else m for i, m in enumerate(full.loss_mask)]
    if not any(mask):
        raise ValueError(f"the response has no tokens left after cutting to {max_tokens} tokens")
    return EncodedChat(full.input_ids, mask)
