"""DPO and GKD (generalized JSD) losses against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from sao_core.objectives.dpo import dpo_loss, sequence_logprobs
from sao_core.objectives.gkd import generalized_jsd_loss

L = math.log


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ----------------------------------------------------------------------------------------------- DPO


def test_sequence_logprobs_sums_masked_tokens_only():
    logp = torch.tensor([[-1.0, -2.0, -3.0, float("inf")], [-0.5, float("nan"), -0.25, -4.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1]])
    got = sequence_logprobs(logp, mask)
    assert torch.allclose(got, torch.tensor([-5.0, -4.75]))
    got.sum().backward()
    assert torch.equal(logp.grad, mask.float())
    with pytest.raises(ValueError, match="expected logprobs"):
        sequence_logprobs(torch.zeros(2, 3), torch.zeros(2, 4))


def test_dpo_loss_value_metrics_and_gradient_by_hand():
    policy_chosen = torch.tensor([-10.0, -8.0], requires_grad=True)
    policy_rejected = torch.tensor([-12.0, -5.0], requires_grad=True)
    ref_chosen = torch.tensor([-11.0, -7.0], requires_grad=True)
    ref_rejected = torch.tensor([-11.0, -7.0], requires_grad=True)
    loss, m = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=0.1)
    # Pair 0: chosen reward 0.1 * (−10 + 11) = 0.1, rejected 0.1 * (−12 + 11) = −0.1, margin 0.2.
    # Pair 1: chosen reward 0.1 * (−8 + 7) = −0.1, rejected 0.1 * (−5 + 7) = 0.2, margin −0.3.
    # −log σ(m) = log(1 + e^{−m}): 0.598139 and 0.854355, mean 0.726247.
    expected = (math.log1p(math.exp(-0.2)) + math.log1p(math.exp(0.3))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert loss.item() == pytest.approx(0.726247, abs=1e-5)
    assert m["reward_accuracy"] == 0.5
    assert m["reward_margin"] == pytest.approx(-0.05, abs=1e-6)
    assert m["chosen_reward"] == pytest.approx(0.0, abs=1e-6)
    assert m["rejected_reward"] == pytest.approx(0.05, abs=1e-6)
    loss.backward()
    # d loss / d πc = −β σ(−margin) / B; d loss / d πr = +β σ(−margin) / B.
    g = torch.tensor([0.1 * _sigmoid(-0.2) / 2, 0.1 * _sigmoid(0.3) / 2])
    assert torch.allclose(policy_chosen.grad, -g, atol=1e-6)
    assert torch.allclose(policy_rejected.grad, g, atol=1e-6)
    assert torch.all(policy_chosen.grad < 0) and torch.all(policy_rejected.grad > 0)  # descent raises chosen
    assert ref_chosen.grad is None and ref_rejected.grad is None


def test_dpo_beta_scales_the_margin_and_large_margins_are_stable():
    zeros = torch.zeros(1)
    loss, m = dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), zeros, zeros, beta=0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), rel=1e-6)   # margin 0.5 * 2 = 1
    assert m["reward_accuracy"] == 1.0
    big, _ = dpo_loss(torch.tensor([-1000.0]), torch.tensor([1000.0]), zeros, zeros, beta=1.0)
    assert big.item() == pytest.approx(2000.0)                                    # −log σ(−2000), no inf
    small, _ = dpo_loss(torch.tensor([1000.0]), torch.tensor([-1000.0]), zeros, zeros, beta=1.0)
    assert small.item() == pytest.approx(0.0, abs=1e-12)
    tie, m_tie = dpo_loss(zeros, zeros, zeros, zeros)
    assert tie.item() == pytest.approx(L(2.0)) and m_tie["reward_accuracy"] == 0.0


def test_dpo_input_errors():
    with pytest.raises(ValueError, match="four \\[B\\] tensors"):
        dpo_loss(torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2), beta=0.0)


# ----------------------------------------------------------------------------------------------- GKD

TEACHER = [0.5, 0.25, 0.25]
STUDENT = [0.1, 0.4, 0.5]


def _logits(probs: list[float], scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.log(torch.tensor(probs))).view(1, 1, 3)


def _kl(p: list[float], q: list[float]) -> float:
    return sum(pi * L(pi / qi) for pi, qi in zip(p, q, strict=True))


def _jsd(beta: float) -> float:
    m = [beta * t + (1 - beta) * s for t, s in zip(TEACHER, STUDENT, strict=True)]
    return beta * _kl(TEACHER, m) + (1 - beta) * _kl(STUDENT, m)


def test_gkd_beta_zero_is_forward_kl_and_its_gradient():
    student = _logits(STUDENT).requires_grad_(True)
    loss, m = generalized_jsd_loss(student, _logits(TEACHER), torch.ones(1, 1), beta=0.0)
    # KL(T ‖ S) = 0.5 ln(0.5/0.1) + 0.25 ln(0.25/0.4) + 0.25 ln(0.25/0.5) = 0.513931
    assert loss.item() == pytest.approx(0.5 * L(5) + 0.25 * L(0.625) + 0.25 * L(0.5), rel=1e-5)
    assert loss.item() == pytest.approx(0.513931, abs=1e-5)
    assert m["tokens"] == 1.0
    loss.backward()
    # ∂ KL(T ‖ softmax(z)) / ∂z = S − T
    assert torch.allclose(student.grad.view(3), torch.tensor([0.1 - 0.5, 0.4 - 0.25, 0.5 - 0.25]), atol=1e-6)


def test_gkd_beta_one_is_reverse_kl():
    loss, _ = generalized_jsd_loss(_logits(STUDENT), _logits(TEACHER), torch.ones(1, 1), beta=1.0)
    # KL(S ‖ T) = 0.1 ln(0.1/0.5) + 0.4 ln(0.4/0.25) + 0.5 ln(0.5/0.25) = 0.373631
    assert loss.item() == pytest.approx(0.1 * L(0.2) + 0.4 * L(1.6) + 0.5 * L(2), rel=1e-5)
    assert loss.item() == pytest.approx(0.373631, abs=1e-5)


def test_gkd_mixture_by_hand():
    loss, _ = generalized_jsd_loss(_logits(STUDENT), _logits(TEACHER), torch.ones(1, 1), beta=0.5)
    # M = (0.3, 0.325, 0.375); KL(T ‖ M) = 0.088456, KL(S ‖ M) = 0.117035; JSD = (0.088456 + 0.117035) / 2
    assert loss.item() == pytest.approx(_jsd(0.5), rel=1e-5)
    assert loss.item() == pytest.approx(0.102746, abs=1e-5)
    # β = 0.25 weighs the teacher term by 0.25 and puts M closer to the student.
    loss_q, _ = generalized_jsd_loss(_logits(STUDENT), _logits(TEACHER), torch.ones(1, 1), beta=0.25)
    m = [0.25 * t + 0.75 * s for t, s in zip(TEACHER, STUDENT, strict=True)]
    assert loss_q.item() == pytest.approx(0.25 * _kl(TEACHER, m) + 0.75 * _kl(STUDENT, m), rel=1e-5)
    assert loss_q.item() != pytest.approx(loss.item(), rel=1e-2)


def test_gkd_temperature_divides_the_logits():
    # Logits 2 · ln(p) at τ = 2 give back p: the same forward KL as at τ = 1 on ln(p).
    at_two, _ = generalized_jsd_loss(_logits(STUDENT, 2.0), _logits(TEACHER, 2.0), torch.ones(1, 1), beta=0.0,
                                     temperature=2.0)
    assert at_two.item() == pytest.approx(0.513931, abs=1e-5)
    at_one, _ = generalized_jsd_loss(_logits(STUDENT, 2.0), _logits(TEACHER, 2.0), torch.ones(1, 1), beta=0.0)
    t2 = [p * p / sum(q * q for q in TEACHER) for p in TEACHER]
    s2 = [p * p / sum(q * q for q in STUDENT) for p in STUDENT]
    assert at_one.item() == pytest.approx(_kl(t2, s2), rel=1e-5)      # sharper distributions, larger KL
    assert at_one.item() > at_two.item()


def test_gkd_mask_selects_positions_and_ignores_garbage():
    # Position 0: student ≠ teacher; position 1: equal; position 2: masked, with non-finite logits.
    student = torch.cat([_logits(STUDENT), _logits(TEACHER), torch.tensor([[[float("nan"), 1e30, 0.0]]])], dim=1)
    teacher = torch.cat([_logits(TEACHER), _logits(TEACHER), torch.tensor([[[float("-inf"), 0.0, float("inf")]]])],
                        dim=1)
    student.requires_grad_(True)
    mask = torch.tensor([[1, 1, 0]])
    loss, m = generalized_jsd_loss(student, teacher, mask, beta=0.0)
    assert loss.item() == pytest.approx(0.513931 / 2, abs=1e-5) and m["tokens"] == 2.0
    loss.backward()
    assert torch.all(torch.isfinite(student.grad)) and torch.all(student.grad[0, 2] == 0)
    only_first, _ = generalized_jsd_loss(student, teacher, torch.tensor([[1, 0, 0]]), beta=0.0)
    assert only_first.item() == pytest.approx(0.513931, abs=1e-5)
    empty, m_empty = generalized_jsd_loss(student, teacher, torch.zeros(1, 3), beta=0.5)
    assert empty.item() == 0.0 and m_empty["tokens"] == 0.0


def test_gkd_zero_when_student_equals_teacher_and_teacher_gets_no_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7) * 3
    mask = torch.ones(2, 4)
    for beta in (0.0, 0.3, 0.5, 1.0):
        student = logits.clone().requires_grad_(True)
        teacher = logits.clone().requires_grad_(True)
        loss, _ = generalized_jsd_loss(student, teacher, mask, beta=beta, temperature=0.7)
        assert abs(loss.item()) < 1e-6
        loss.backward()
        assert student.grad.abs().max() < 1e-6
        assert teacher.grad is None


def test_gkd_input_errors():
    s, t, mask = torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), torch.ones(1, 2)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd_loss(s, t, mask, beta=-0.1)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd_loss(s, t, mask, beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        generalized_jsd_loss(s, t, mask, temperature=0.0)
    with pytest.raises(ValueError, match="one shape"):
        generalized_jsd_loss(s, torch.zeros(1, 2, 4), mask)
    with pytest.raises(ValueError, match="mask"):
        generalized_jsd_loss(s, t, torch.ones(1, 3))
