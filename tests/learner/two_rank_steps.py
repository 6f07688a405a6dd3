"""The fixed learner steps that tests/learner/test_learner_distributed.py runs once under torchrun (FSDP2, gloo;
tests/scripts/learner_step_worker.py) and once in the test's own process, to compare the two:

- plain steps: two steps per method (SAO with its critic, GRPO+DIS) on `fixed_batch`, whitened advantages,
  the default micro-batch budget;
- micro-batched steps: two steps per method on test_learner_microbatch's batch at its DIST_BUDGET (under
  torchrun the ranks hold different numbers of micro-batches; rank 0 runs a filler pass).

One torchrun launch computes both, so the two comparisons pay for one start of two processes.
"""

from __future__ import annotations

import torch
from test_learner_microbatch import DIST_BUDGET, run_steps

from sao_core.learner.batch import collate
from sao_core.learner.config import RLConfig
from sao_core.learner.updates import Updater
from sao_core.models import load_model_and_tokenizer
from sao_core.models.value import ValueModel
from sao_core.rollout.trajectory import Trajectory
from sao_core.training.distributed import DistContext, shard_model

#: the methods both comparisons step: SAO (critic + DIS) and GRPO+DIS
METHODS = ("sao", "grpo_dis")


def fixed_batch(tokenizer, model_dir: str) -> list[Trajectory]:
    """Eight trajectories in four groups of two, with action lengths from 3 to 40 tokens, so the two ranks
    hold very different numbers of action tokens (114 and 18: the case a per-rank mean would get wrong).
    Rollout log-probs are the initial policy's plus noise, so most ratios fall inside the DIS band."""
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


def plain_steps(model_dir: str, ctx: DistContext) -> dict:
    """Two learner steps per method on `fixed_batch` (lr 1e-3, whitened advantages) from the same initial
    weights. Returns {"metrics": {"sao/0", "sao/1", "grpo_dis/0", "grpo_dis/1"}: metrics dict,
    "weights": {"sao", "grpo_dis", "critic"}: full state dict}; under torchrun only rank 0's weights hold
    tensors (the gather is collective)."""
    metrics, weights = {}, {}
    for method in METHODS:
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
            metrics[f"{method}/{step}"] = updater.step(batch, step)[0]
        state = updater.full_model_states()
        weights[method] = dict(state["policy"])
        if critic is not None:
            weights["critic"] = dict(state["critic"])
    return {"metrics": metrics, "weights": weights}


def micro_batched_steps(model_dir: str, ctx: DistContext) -> dict:
    """Two steps per method on test_learner_microbatch's fixed batch with micro-batches of DIST_BUDGET
    padded tokens (whitened advantages). Returns {method: {"metrics": [per step], "policy": state dict,
    "critic": state dict or None}}."""
    results = {}
    for method in METHODS:
        metrics, policy, critic, _ = run_steps(model_dir, method, DIST_BUDGET, whiten=True, ctx=ctx)
        results[method] = {"metrics": metrics, "policy": policy, "critic": critic}
    return results
