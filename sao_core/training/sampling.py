"""Plain ancestral sampling from a causal LM, in lock-step over ranks.

Every call runs exactly `max_new_tokens` forward passes, whatever the rows sample: under FSDP2 each
forward is a collective, so all ranks must run the same number of them.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def sample_continuations(model, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                         pad_id: int, eos_id: int, generator: torch.Generator,
                         device: torch.device) -> list[list[int]]:
    """Sample a continuation of each prompt (token ids); each stops after its first `eos_id`.

    Args:
        prompts: token ids per row (lengths may differ; rows are left-padded internally).
        max_new_tokens: forward passes to run (tokens per continuation at most).
        temperature: softmax temperature (> 0).
        generator: CPU torch.Generator, so the draw is reproducible.
    Returns:
        The sampled ids per row, ending with `eos_id` when the row stopped.
    """
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention[row, width - len(prompt):] = 1
    ids, attention = ids.to(device), attention.to(device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    produced: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions,
                       use_cache=False, logits_to_keep=1).logits[:, -1].float()
        probs = torch.softmax(logits / temperature, dim=-1).cpu()
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1).to(device)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        for row in torch.nonzero(~done).flatten().tolist():
            produced[row].append(int(nxt[row]))
        done |= nxt == eos_id
        ids = torch.cat([ids, nxt.unsqueeze(1)], dim=1)
        attention = torch.cat([attention, (~done | (nxt == eos_id)).long().unsqueeze(1)], dim=1)
    return produced
