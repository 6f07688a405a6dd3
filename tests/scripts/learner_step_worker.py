"""One learner step per method on a fixed batch, in one process or under torchrun (FSDP2, gloo).

Used by tests/learner/test_learner_distributed.py: the metrics (grad norms, losses, mask fractions) and the
updated weights of a 2-rank run must equal those of one process on the same batch.

    python tests/scripts/learner_step_worker.py MODEL_DIR OUT.json [OUT.pt]
"""

from __future__ import annotations

import json
import sys

import torch

from sao_core.learner.batch import collate
from sao_core.learner.config import RLConfig
from sao_core.learner.updates import Updater
from sao_core.models import load_model_and_tokenizer
from sao_core.models.value import ValueModel
from sao_core.rollout.trajectory import Trajectory
from sao_core.training.distributed import init_distributed, shard_model


def fixed_batch(tokenizer, model_dir: str) -> list[Trajectory]:
    """Eight trajectories in four groups of two, with action lengths from 3 to 40 tokens, so the two ranks
    hold very different numbers of action tokens (the case a per-rank mean would get wrong). Rollout
    log-probs are the initial policy's plus noise, so most ratios fall inside the DIS band."""
    from sao_core.objectives.common import token_logprobs

    reference, _ = load_model_and_tokenizer(model_dir, "/nonexistent-cache")
    gen = torch.Generator().manual_seed(7)
    rows = []
    for i in range(8):
        prompt = tokenizer.encode(f"<|im_start|>user\nCompute {i} + {i * 3}<|im_end|>\n<|im_start|>assistant\n",
                                  add_special_tokens=False)
        length = [40, 31, 25, 18, 3, 5, 4, 6][i]
        action = torch.randint(5, 500, (length,), generator=gen).tolist()
        ids = torch.tensor([prompt + action])
        with torch.no_grad():
            exact = token_logprobs(reference(input_ids=ids).logits, ids)[0, len(prompt):]
        logprobs = (exact + (torch.rand(length, generator=gen) - 0.5) * 0.6).tolist()
        rows.append(Trajectory(id=f"t{i}", prompt_id=f"p{i // 2}", env="tool_arith", token_ids=prompt + action,
                               action_mask=[0] * len(prompt) + [1] * length,
                               rollout_logprobs=[0.0] * len(prompt) + logprobs,
                               versions=[-1] * len(prompt) + [0] * length, reward=float(i % 2 == 0 or i == 5),
                               num_turns=1, finish_reason="stop", metadata={"epoch": 0}))
    return rows


def main() -> int:
    model_dir, out_json = sys.argv[1], sys.argv[2]
    out_weights = sys.argv[3] if len(sys.argv) > 3 else None
    ctx = init_distributed()
    results = {}
    weights = {}
    for method in ("sao", "grpo_dis"):
        torch.manual_seed(0)
        policy, tokenizer = load_model_and_tokenizer(model_dir, "/nonexistent-cache")
        critic = ValueModel.from_pretrained(model_dir) if method == "sao" else None
        policy = shard_model(policy, ctx)
        critic = shard_model(critic, ctx) if critic is not None else None
        config = RLConfig(data="unused", output="unused", method=method, batch_size=8, group_size=2,
                          policy_lr=1e-3, critic_lr=1e-3, critic_warmup_steps=0, whiten_advantages=True)
        updater = Updater(config, policy, critic, ctx)
        batch = collate(fixed_batch(tokenizer, model_dir), tokenizer.pad_token_id)
        for step in range(2):
            metrics, changed = updater.step(batch, step)
            results[f"{method}/{step}"] = metrics
        state = updater.full_model_states()  # collective; full tensors on rank 0
        weights[method] = {k: v for k, v in state["policy"].items()}
        if critic is not None:
            weights["critic"] = {k: v for k, v in state["critic"].items()}
    if ctx.is_main:
        with open(out_json, "w") as f:
            json.dump({"world_size": ctx.world_size, "metrics": results}, f)
        if out_weights:
            torch.save(weights, out_weights)
    return 0


if __name__ == "__main__":
    sys.exit(main())
