"""SAO objectives against values computed by hand: DIS policy loss, skip-observation GAE, adaptive λ."""

from __future__ import annotations

import math

import pytest
import torch

from sao_core.objectives.gae import adaptive_lambda, skip_observation_gae
from sao_core.objectives.sao import dis_policy_loss

L = math.log


def _dis_batch():
    # Row 0: [prompt, a1, a2, a3, a4, pad]; row 1: [a, obs, a, pad, pad, pad].
    logp = torch.tensor([[0.0, L(0.7), 0.0, L(0.5), L(0.1), 3.0],
                         [L(0.4), 0.0, L(0.9), 7.0, 0.0, 0.0]], requires_grad=True)
    rollout = torch.tensor([[0.0, 0.0, -L(6.0), L(0.5), 0.0, -1000.0],
                            [L(0.5), 0.0, L(0.6), -1000.0, 0.0, 0.0]])
    adv = torch.tensor([[0.0, 1.0, 1.0, 2.0, -1.0, 0.0],
                        [-0.5, 0.0, 0.25, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0],
                         [1, 0, 1, 0, 0, 0]])
    return logp, rollout, adv, mask


def test_dis_loss_value_gradient_and_metrics_by_hand():
    logp, rollout, adv, mask = _dis_batch()
    loss, m = dis_policy_loss(logp, rollout, adv, mask)
    # Kept: row0 a3 (r = 1, A = 2); row1 a (r = 0.8, A = -0.5); row1 a (r = 1.5, A = 0.25).
    # Masked: r = 0.7 exactly (low edge), r = 6 exactly (high edge), r = 0.1 with A < 0 (sign-independent).
    expected = -(1.0 * 2.0 * L(0.5) + 0.8 * -0.5 * L(0.4) + 1.5 * 0.25 * L(0.9)) / 6
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    grad = torch.zeros(2, 6)
    grad[0, 3] = -1.0 * 2.0 / 6
    grad[1, 0] = -0.8 * -0.5 / 6
    grad[1, 2] = -1.5 * 0.25 / 6
    assert torch.allclose(logp.grad, grad, atol=1e-6)
    assert m["action_tokens"] == 6
    assert m["kept"] == pytest.approx(3 / 6) and m["masked_low"] == pytest.approx(2 / 6)
    assert m["masked_high"] == pytest.approx(1 / 6)
    assert m["kept_pos"] == pytest.approx(2 / 6) and m["kept_neg"] == pytest.approx(1 / 6)
    assert m["masked_low_pos"] == pytest.approx(1 / 6) and m["masked_low_neg"] == pytest.approx(1 / 6)
    assert m["masked_high_pos"] == pytest.approx(1 / 6) and m["masked_high_neg"] == 0.0
    assert math.isfinite(m["ratio_mean"])


def test_dis_band_edges_are_strict_and_just_inside_is_kept():
    mask = torch.ones(1, 4)
    adv = torch.ones(1, 4)
    rollout = torch.zeros(1, 4)
    # ratios: exactly 1 - eps_low, just above it, exactly 1 + eps_high, just below it (eps_low = 0.3, eps_high = 5).
    logp = torch.log(torch.tensor([[0.7, 0.7001, 6.0, 5.999]]))
    _, m = dis_policy_loss(logp, rollout, adv, mask)
    assert m["masked_low"] == 0.25 and m["masked_high"] == 0.25 and m["kept"] == 0.5
    # Agentic-coding band (0.8, 3.0): the same edges move.
    logp2 = torch.log(torch.tensor([[0.2, 0.21, 4.0, 3.99]]))
    _, m2 = dis_policy_loss(logp2, rollout, adv, mask, eps_low=0.8, eps_high=3.0)
    assert m2["masked_low"] == 0.25 and m2["masked_high"] == 0.25 and m2["kept"] == 0.5


def test_dis_no_action_tokens_and_padding_give_no_nan():
    logp = torch.tensor([[5.0, 80.0]], requires_grad=True)
    loss, m = dis_policy_loss(logp, torch.tensor([[-500.0, -900.0]]), torch.ones(1, 2), torch.zeros(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logp.grad == 0) and m["kept"] == 0.0


def test_dis_masked_tokens_stay_in_denominator():
    logp = torch.tensor([[L(0.5), L(0.01)]], requires_grad=True)
    rollout = torch.tensor([[L(0.5), L(0.5)]])
    loss, _ = dis_policy_loss(logp, rollout, torch.ones(1, 2), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-L(0.5) / 2)


def test_dis_input_errors():
    with pytest.raises(ValueError, match="one shape"):
        dis_policy_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 2), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="eps_low"):
        dis_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), eps_low=1.5)


def test_skip_observation_gae_by_hand():
    # Row 0: [prompt, a, a, obs, obs, a, pad]; observation values (9) must be ignored, the action before
    # the observations bootstraps from the next action token's value (0.4).
    values = torch.tensor([[9.0, 0.5, 0.2, 9.0, 9.0, 0.4, 9.0],
                           [9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0],
                           [0.5, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0],
                         [0, 0, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0, 0]])
    rewards = torch.tensor([1.0, 1.0, 1.0])
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # deltas: 0.2-0.5 = -0.3, 0.4-0.2 = 0.2, 1-0.4 = 0.6 ; A = (-0.05, 0.5, 0.6)
    assert torch.allclose(adv[0], torch.tensor([0, -0.05, 0.5, 0, 0, 0.6, 0]), atol=1e-6)
    assert torch.allclose(ret[0], torch.tensor([0, 0.45, 0.7, 0, 0, 1.0, 0]), atol=1e-6)
    assert torch.all(adv[1] == 0) and torch.all(ret[1] == 0)   # no action tokens: zeros, no NaN
    # Row 2 with lam 0.5: deltas 0.2-0.5 = -0.3, 1-0.2 = 0.8 ; A = (-0.3 + 0.4, 0.8)
    assert torch.allclose(adv[2, :2], torch.tensor([0.1, 0.8]), atol=1e-6)


def test_lambda_one_gives_monte_carlo_returns_and_per_row_lambda():
    values = torch.tensor([[0.3, 0.9, 0.1, 0.0], [0.5, 0.2, 0.7, 0.0]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 0]])
    rewards = torch.tensor([2.0, -1.0])
    _, ret = skip_observation_gae(rewards, values, mask, lam=1.0)
    assert torch.allclose(ret, torch.tensor([[2.0, 0.0, 2.0, 2.0], [-1.0, -1.0, -1.0, 0.0]]))
    adv, _ = skip_observation_gae(rewards, values, mask, lam=torch.tensor([1.0, 0.0]))
    assert torch.allclose(adv[0], torch.tensor([1.7, 0.0, 1.9, 2.0]))          # λ = 1: R − V
    assert torch.allclose(adv[1], torch.tensor([-0.3, 0.5, -1.7, 0.0]))        # λ = 0: one-step TD


def test_gamma_discount_by_hand():
    values = torch.tensor([[0.5, 0.2]])
    adv, ret = skip_observation_gae(torch.tensor([1.0]), values, torch.ones(1, 2), gamma=0.9, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.4, 0.8]]))
    assert torch.allclose(ret, torch.tensor([[0.9, 1.0]]))


def test_gae_shape_errors():
    with pytest.raises(ValueError, match="expected rewards"):
        skip_observation_gae(torch.zeros(2), torch.zeros(1, 3), torch.zeros(1, 3))


def test_adaptive_lambda_by_hand():
    got = adaptive_lambda(torch.tensor([0, 1, 2, 10]), alpha=1.5)
    assert torch.allclose(got, torch.tensor([0.0, 1 / 3, 2 / 3, 14 / 15]))


def test_value_loss_by_hand_with_and_without_clipping():
    from sao_core.objectives.sao import value_loss

    values = torch.tensor([[0.0, 0.5, 0.9, 7.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.1, 0.8, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[0, 1, 1, 0]])
    loss, m = value_loss(values, old, returns, mask)
    assert loss.item() == pytest.approx((0.25 + 0.01) / 2)
    loss.backward()
    assert torch.allclose(values.grad, torch.tensor([[0.0, -0.5, -0.1, 0.0]]))
    # clip 0.2: token 1 moved 0.4 from old 0.1 -> clipped value 0.3, error 0.49 > 0.25; token 2 unclipped.
    clipped, _ = value_loss(values, old, returns, mask, clip=0.2)
    assert clipped.item() == pytest.approx((0.49 + 0.01) / 2)
    assert m["value_mean"] == pytest.approx(0.7)
