"""Turn chat conversations into token ids with a loss mask, and pad them into batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EncodedChat:
    """One conversation as tokens: `loss_mask[t]` is 1 where token t was produced by the assistant."""

    input_ids: list[int]
    loss_mask: list[int]


def _render(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


def _marks_generation(tokenizer) -> bool:
    """Whether the chat template marks the assistant's tokens itself ({% generation %} blocks)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    templates = template.values() if isinstance(template, dict) else [template]
    return any("generation" in t and "endgeneration" in t for t in templates)


def assistant_spans_by_prefix(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, mask) of `messages` for a template without {% generation %} blocks (most released models': Llama 3,
    Qwen, SmolLM2, Mistral): each assistant message's tokens are those between the rendering of the messages
    before it with the generation prompt and the rendering up to and including it, through its last
    end-of-turn (eos) token (what follows it, e.g. a newline, is the template's). ValueError when a rendering is not a prefix of the whole conversation's (a template that
    rewrites earlier turns, e.g. one that drops past reasoning): then the tokens cannot be attributed."""
    ids = _render(tokenizer, messages)
    mask = [0] * len(ids)
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:index], add_generation_prompt=True) if index else []
        through = _render(tokenizer, messages[:index + 1])
        if ids[:len(before)] != before or ids[:len(through)] != through or len(through) < len(before):
            raise ValueError(f"the chat template renders the conversation up to message {index} differently from "
                             "the whole conversation (it rewrites earlier turns), and it has no {% generation %} "
                             "block: the assistant's tokens cannot be told apart")
        end = len(through)
        eos = tokenizer.eos_token_id
        ends = [i for i in range(len(before), end) if ids[i] == eos] if isinstance(eos, int) else []
        if ends:   # the template's scaffolding after the end-of-turn token (a newline) is not the assistant's
            end = ends[-1] + 1
        mask[len(before):end] = [1] * (end - len(before))
    return ids, mask


def encode_chat(tokenizer, messages: list[dict], max_tokens: int) -> EncodedChat:
    """Render `messages` with the tokenizer's chat template; mask = assistant tokens; cut to `max_tokens`.

    The assistant's tokens come from the template's {% generation %} blocks when it has them, else from
    renderings of the conversation's prefixes (`assistant_spans_by_prefix`). Raises ValueError when no
    assistant token survives the cut, or when neither way can tell the assistant's tokens apart.
    """
    if _marks_generation(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        ids, mask = assistant_spans_by_prefix(tokenizer, messages)
    ids, mask = ids[:max_tokens], mask[:max_tokens]
    if not any(mask):
        raise ValueError(f"no assistant tokens to learn in this conversation (after cutting to {max_tokens} tokens)")
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
