"""GRPO baselines against values computed by hand: group advantages, PPO clip loss, running-mean baseline."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sao_core.objectives.grpo import RunningMeanBaseline, group_advantages, ppo_clip_loss

L = math.log


def test_group_advantages_two_interleaved_groups_of_different_sizes():
    rewards = torch.tensor([1.0, 4.0, 3.0, 0.0, 5.0, 3.0])
    ids = torch.tensor([10, 3, 10, 3, 10, 10])
    # Group 10: rewards 1, 3, 5, 3 -> mean 3, deviations -2, 0, 2, 0, sample variance 8/3.
    # Group 3: rewards 4, 0 -> mean 2, deviations 2, -2, sample variance 8 / 1 = 8.
    s10, s3 = math.sqrt(8 / 3) + 1e-6, math.sqrt(8.0) + 1e-6
    expected = torch.tensor([-2 / s10, 2 / s3, 0.0, -2 / s3, 2 / s10, 0.0])
    got = group_advantages(rewards, ids)
    assert got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=1e-6)
    assert got[0].item() == pytest.approx(-1.2247449, abs=1e-5)     # -2 / 1.6329932
    assert got[1].item() == pytest.approx(0.7071068, abs=1e-5)      # 2 / 2.8284271
    # Same numbers as torch.std (unbiased) per group.
    assert torch.allclose(got[[0, 2, 4, 5]], (rewards[[0, 2, 4, 5]] - 3) / (rewards[[0, 2, 4, 5]].std() + 1e-6))


def test_group_advantages_without_scaling():
    rewards = torch.tensor([1.0, 4.0, 3.0, 0.0, 5.0, 3.0])
    ids = torch.tensor([10, 3, 10, 3, 10, 10])
    got = group_advantages(rewards, ids, scale=False)
    assert torch.equal(got, torch.tensor([-2.0, 2.0, 0.0, -2.0, 2.0, 0.0]))


def test_group_of_one_and_all_equal_rewards_give_zero_without_nan():
    got = group_advantages(torch.tensor([5.0, 1.0, 2.0]), torch.tensor([-7, 100, 100]))
    assert got[0].item() == 0.0
    assert torch.allclose(got[1:], torch.tensor([-0.5 / (math.sqrt(0.5) + 1e-6), 0.5 / (math.sqrt(0.5) + 1e-6)]))
    same = group_advantages(torch.tensor([2.0, 2.0, 2.0, 7.0]), torch.tensor([0, 0, 0, 1]))
    assert torch.equal(same, torch.zeros(4))
    assert torch.equal(group_advantages(torch.tensor([3.0]), torch.tensor([0])), torch.zeros(1))


def test_group_advantages_input_errors():
    with pytest.raises(ValueError, match="expected rewards"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        group_advantages(torch.zeros(3), torch.zeros(3))


def _ppo_batch(pad_logp: float = 1e4, pad_old: float = float("inf")):
    # Row 0: [prompt, a1, a2, a3, pad]; row 1: [a1, a2, pad, pad, pad]. old log-prob log(0.4) on actions.
    old = torch.tensor([[0.0, L(0.4), L(0.4), L(0.4), pad_old],
                        [L(0.4), L(0.4), pad_old, pad_old, -1e4]])
    # ratios: row 0 -> 0.5, 1.5, 0.5 ; row 1 -> 1.5, 1.0.
    logp = torch.tensor([[-3.0, L(0.2), L(0.6), L(0.2), pad_logp],
                         [L(0.6), L(0.4), pad_logp, -pad_logp, 1e4]], requires_grad=True)
    adv = torch.tensor([[5.0, -2.0, 1.0, 1.0, 9.0],
                        [-1.0, 0.5, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0],
                         [1, 1, 0, 0, 0]])
    return logp, old, adv, mask


def test_ppo_clip_loss_value_gradient_and_metrics_by_hand():
    logp, old, adv, mask = _ppo_batch()
    loss, m = ppo_clip_loss(logp, old, adv, mask)
    # row0 a1: r 0.5, A -2 -> -min(-1.0, 0.8 * -2 = -1.6) = 1.6 (pessimistic clipped term, no gradient)
    # row0 a2: r 1.5, A +1 -> -min(1.5, 1.28) = -1.28 (clipped high, no gradient)
    # row0 a3: r 0.5, A +1 -> -min(0.5, 0.8) = -0.5 (unclipped)
    # row1 a1: r 1.5, A -1 -> -min(-1.5, -1.28) = 1.5 (unclipped)
    # row1 a2: r 1.0, A 0.5 -> -0.5
    assert loss.item() == pytest.approx((1.6 - 1.28 - 0.5 + 1.5 - 0.5) / 5, rel=1e-5)   # 0.164
    loss.backward()
    # d(-r A)/dlogp = -r A on unclipped tokens, divided by the 5 action tokens.
    grad = torch.tensor([[0.0, 0.0, 0.0, -0.5 / 5, 0.0],
                         [1.5 / 5, -0.5 / 5, 0.0, 0.0, 0.0]])
    assert torch.allclose(logp.grad, grad, atol=1e-6)
    assert logp.grad[0, 1] == 0.0 and logp.grad[0, 2] == 0.0     # exactly zero where clipped
    assert m["action_tokens"] == 5
    assert m["clip_frac_low"] == pytest.approx(1 / 5) and m["clip_frac_high"] == pytest.approx(1 / 5)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["ratio_mean"] == pytest.approx((0.5 + 1.5 + 0.5 + 1.5 + 1.0) / 5, rel=1e-5)
    assert m["loss"] == pytest.approx(0.164, rel=1e-5)


def test_ppo_clip_custom_range():
    # r 0.5 with A -2 and clip_low 0.6: 0.5 lies inside [0.4, ...], so the unclipped -r A = 1.0 is taken.
    logp = torch.tensor([[L(0.2)]], requires_grad=True)
    loss, m = ppo_clip_loss(logp, torch.tensor([[L(0.4)]]), torch.tensor([[-2.0]]), torch.ones(1, 1), clip_low=0.6)
    assert loss.item() == pytest.approx(1.0, rel=1e-5) and m["clip_frac"] == 0.0
    loss.backward()
    assert logp.grad.item() == pytest.approx(1.0, rel=1e-5)


def test_ppo_padding_with_huge_or_infinite_logprobs_gives_no_nan():
    for pad_logp, pad_old in [(1e4, -1e4), (1e4, float("inf")), (float("inf"), float("inf"))]:
        logp, old, adv, mask = _ppo_batch(pad_logp, pad_old)
        loss, m = ppo_clip_loss(logp, old, adv, mask)
        loss.backward()
        assert torch.isfinite(loss) and torch.all(torch.isfinite(logp.grad))
        assert loss.item() == pytest.approx(0.164, rel=1e-5)
        assert all(math.isfinite(v) for v in m.values())


def test_ppo_token_mean_is_over_all_action_tokens_of_the_batch():
    # Ratios 1: loss = -Σ A / Σ mask = -(4 + 1 + 1 + 1) / 4 = -1.75 (a mean of row means would give -2.5).
    logp = torch.full((2, 3), L(0.5))
    adv = torch.tensor([[4.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    loss, m = ppo_clip_loss(logp, logp.clone(), adv, mask)
    assert loss.item() == pytest.approx(-1.75) and m["action_tokens"] == 4


def test_ppo_no_action_tokens_and_input_errors():
    logp = torch.tensor([[5.0, 80.0]], requires_grad=True)
    loss, m = ppo_clip_loss(logp, torch.tensor([[-500.0, -900.0]]), torch.ones(1, 2), torch.zeros(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logp.grad == 0) and m["clip_frac"] == 0.0
    with pytest.raises(ValueError, match="one shape"):
        ppo_clip_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 2), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="clip_low"):
        ppo_clip_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), clip_low=1.5)


def test_running_mean_baseline_sequence_by_hand():
    base = RunningMeanBaseline(window=2, global_window=3)
    # (prompt, reward, expected advantage); histories after each step in the comments.
    steps = [
        ("a", 1.0, 1.0),        # nothing seen: baseline 0             a [1]       global [1]
        ("a", 3.0, 2.0),        # a mean 1                             a [1, 3]    global [1, 3]
        ("b", 2.0, 0.0),        # b new: global mean (1 + 3) / 2 = 2   b [2]       global [1, 3, 2]
        ("a", 5.0, 3.0),        # a mean 2; 1 drops out of a           a [3, 5]    global [3, 2, 5]
        ("a", 0.0, -4.0),       # a mean 4 (window 2: the 1 is gone)   a [5, 0]    global [2, 5, 0]
        ("c", 1.0, 1.0 - 7 / 3),  # c new: global mean (2 + 5 + 0) / 3  c [1]       global [5, 0, 1]
        ("b", 4.0, 2.0),        # b mean 2                             b [2, 4]    global [0, 1, 4]
    ]
    for prompt, reward, expected in steps:
        assert base.advantage(prompt, reward) == pytest.approx(expected)
    assert base.baseline("a") == pytest.approx(2.5)
    assert base.baseline("unseen") == pytest.approx(5 / 3)


def test_running_mean_baseline_state_round_trip():
    base = RunningMeanBaseline(window=2, global_window=3)
    for prompt, reward in [("a", 1.0), ("a", 3.0), ("b", 2.0), ("a", 5.0), ("a", 0.0)]:
        base.advantage(prompt, reward)
    state = json.loads(json.dumps(base.state_dict()))
    assert state == {"window": 2, "global_window": 3, "per_prompt": {"a": [5.0, 0.0], "b": [2.0]},
                     "global": [2.0, 5.0, 0.0]}
    restored = RunningMeanBaseline(window=2, global_window=3)
    restored.load_state_dict(state)
    for prompt, reward in [("a", 2.0), ("z", 1.0), ("b", -1.0)]:
        assert restored.advantage(prompt, reward) == base.advantage(prompt, reward)
    assert restored.state_dict() == base.state_dict()
    # A smaller window keeps only the most recent rewards.
    narrow = RunningMeanBaseline(window=1, global_window=1)
    narrow.load_state_dict(state)
    assert narrow.baseline("a") == 0.0 and narrow.baseline("new") == 0.0
    with pytest.raises(ValueError, match="RunningMeanBaseline state"):
        narrow.load_state_dict({"per_prompt": {}})
    with pytest.raises(ValueError, match="window"):
        RunningMeanBaseline(window=0)
