"""The RL learner uses the shared training core: precision (bf16 selectable on CPU), the schedule with
warm-up for the policy and the critic, activation checkpointing, and the one checkpoint format."""

from __future__ import annotations

import pytest
import torch
from test_learner_microbatch import fixed_trajectories

from sao_core.learner.batch import collate
from sao_core.learner.config import RLConfig
from sao_core.learner.updates import Updater
from sao_core.training.core import prepare_model
from sao_core.training.distributed import DistContext


def make_updater(model_dir: str, **overrides) -> tuple[Updater, object]:
    from sao_core.models import load_model_and_tokenizer
    from sao_core.models.value import ValueModel

    torch.manual_seed(0)
    policy, tokenizer = load_model_and_tokenizer(model_dir, "/nonexistent-cache")
    fields = dict(data="unused", output="unused", method="sao", batch_size=8, policy_lr=5e-4, critic_lr=5e-4,
                  critic_warmup_steps=0) | overrides
    config = RLConfig(**fields)
    ctx = DistContext()
    policy = prepare_model(policy, ctx, config.gradient_checkpointing)
    critic = prepare_model(ValueModel.from_pretrained(model_dir), ctx, config.gradient_checkpointing)
    return Updater(config, policy, critic, ctx), collate(fixed_trajectories(model_dir), tokenizer.pad_token_id)


def test_bf16_learner_step_on_cpu_keeps_float32_master_weights(tiny_model_dir):
    runs = {}
    for precision in ("float32", "bf16"):
        updater, batch = make_updater(tiny_model_dir, precision=precision)
        runs[precision] = [updater.step(batch, step)[0] for step in range(2)]
        for model, optimizer in updater.checkpoint_parts().values():
            assert all(p.dtype == torch.float32 for p in model.parameters())
            assert all(v.dtype == torch.float32 for state in optimizer.state.values()
                       for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    fp32, bf16 = runs["float32"][0], runs["bf16"][0]
    # The rollout log-probs are float32 recomputations plus noise: the bf16 forward differs a little.
    assert fp32["logp_diff_mean"] == pytest.approx(bf16["logp_diff_mean"], rel=0.2)
    assert fp32["policy_loss"] != bf16["policy_loss"]
    assert bf16["policy_grad_norm"] == pytest.approx(fp32["policy_grad_norm"], rel=0.1)
    assert bf16["critic_loss"] == pytest.approx(fp32["critic_loss"], rel=0.1)


def test_rl_schedule_warms_up_policy_and_critic(tiny_model_dir):
    updater, batch = make_updater(tiny_model_dir, schedule="linear", warmup_steps=2, steps=6,
                                  critic_warmup_steps=1, gradient_checkpointing=True)
    metrics = [updater.step(batch, step)[0] for step in range(4)]
    # Linear warm-up over 2 updates, then linear decay to 0 at the end. Critic: one rate per learner step over
    # 6 steps. Policy: over its 5 updates, from the second step (the first is the critic's warm-up).
    assert [m["critic_lr"] for m in metrics] == pytest.approx([2.5e-4, 5e-4, 5e-4, 5e-4 * 3 / 4])
    assert "policy_lr" not in metrics[0]
    assert [m["policy_lr"] for m in metrics[1:]] == pytest.approx([2.5e-4, 5e-4, 5e-4])


def test_paper_defaults_stay_constant():
    config = RLConfig(data="d", output="o")
    assert (config.schedule, config.warmup_steps, config.policy_lr, config.critic_lr, config.weight_decay) == (
        "constant", 0, 1e-6, 5e-6, 0.0)
    with pytest.raises(ValueError, match="RLConfig.precision must be one of auto, float32, bf16"):
        RLConfig(data="d", output="o", precision="half").validate()
    with pytest.raises(ValueError, match="RLConfig.schedule must be one of"):
        RLConfig(data="d", output="o", schedule="step").validate()
