"""Length-bucketed micro-batches in the learner step (`RLConfig.micro_batch_tokens`): the grouping, and the
exactness of the update: a step on micro-batches gives the same weights and metrics as one pass over the
whole padded batch, in one process. Under torchrun (where the ranks hold different numbers of groups):
test_learner_distributed.py's test_two_rank_micro_batched_step_equals_the_single_process_step, which steps the
batch below at DIST_BUDGET.
"""

from __future__ import annotations

import random

import pytest
import torch

from sao_core.learner.batch import collate, micro_batch_rows
from sao_core.learner.config import RLConfig

# Total lengths (prompt + actions + observations) of the fixed batch: long-tailed, long and short mixed.
LENGTHS = [150, 12, 120, 20, 90, 8, 100, 30]
# 8 rows of the batch above: 150, 120, 100, 90 alone (budget), then 30 with 20, and 12 with 8 (a row joins a
# group only when at least half as long as its longest): 6 micro-batches.
BUDGET = 160
# Under torchrun rank 0 holds rows 150, 12, 120, 20 (groups 150+120 and 20+12 at this budget), rank 1 rows
# 90, 8, 100, 30 (groups 100+90, 30 and 8): rank 0 runs a filler pass.
DIST_BUDGET = 300


def fixed_trajectories(model_dir: str):
    """Eight trajectories (four groups of two) of the lengths in LENGTHS: a 5-token prompt, then actions;
    rows longer than 25 tokens have an observation of 6 tokens between two action segments. Rollout log-probs
    are the initial policy's plus noise, so most DIS ratios fall inside the band."""
    from sao_core.models import load_model_and_tokenizer
    from sao_core.objectives.common import token_logprobs
    from sao_core.rollout.trajectory import Trajectory

    reference, _ = load_model_and_tokenizer(model_dir, "/nonexistent-cache")
    gen = torch.Generator().manual_seed(11)
    rows = []
    for i, total in enumerate(LENGTHS):
        body = total - 5
        first = body // 2 if body > 20 else body
        mask = [0] * 5 + [1] * first + ([0] * 6 + [1] * (body - first - 6) if body > 20 else [])
        ids = torch.randint(5, 500, (total,), generator=gen)
        with torch.no_grad():
            exact = token_logprobs(reference(input_ids=ids[None]).logits, ids[None])[0]
        noisy = exact + (torch.rand(total, generator=gen) - 0.5) * 0.6
        rows.append(Trajectory(id=f"t{i}", prompt_id=f"p{i // 2}", env="tool_arith", token_ids=ids.tolist(),
                               action_mask=mask, rollout_logprobs=[float(v) if m else 0.0 for v, m in
                                                                   zip(noisy, mask, strict=True)],
                               versions=[0 if m else -1 for m in mask], reward=float(i % 2 == 0 or i == 5),
                               num_turns=1, finish_reason="stop", metadata={"epoch": 0}))
    return rows


def run_steps(model_dir: str, method: str, budget: int, whiten: bool = False, ctx=None, steps: int = 2):
    """`steps` learner steps on the fixed batch from the same initial weights; returns (metrics per step,
    policy state, critic state or None, initial policy state)."""
    from sao_core.learner.updates import Updater
    from sao_core.models import load_model_and_tokenizer
    from sao_core.models.value import ValueModel
    from sao_core.training.distributed import shard_model

    torch.manual_seed(0)
    policy, tokenizer = load_model_and_tokenizer(model_dir, "/nonexistent-cache")
    initial = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    critic = ValueModel.from_pretrained(model_dir) if method == "sao" else None
    if ctx is not None:
        policy, critic = shard_model(policy, ctx), shard_model(critic, ctx) if critic is not None else None
    config = RLConfig(data="unused", output="unused", method=method, batch_size=8, group_size=2, policy_lr=5e-4,
                      critic_lr=5e-4, critic_warmup_steps=0, whiten_advantages=whiten, micro_batch_tokens=budget)
    updater = Updater(config, policy, critic, ctx)
    batch = collate(fixed_trajectories(model_dir), tokenizer.pad_token_id)
    metrics = [updater.step(batch, step)[0] for step in range(steps)]
    state = updater.full_model_states()
    return metrics, state["policy"], state.get("critic"), initial


# ----------------------------------------------------------------------------------------------- grouping
def test_grouping_respects_the_budget_and_covers_every_row_once():
    rng = random.Random(3)
    for _ in range(200):
        lengths = [int(rng.paretovariate(1.2) * 10) for _ in range(rng.randint(1, 40))]
        budget = rng.choice([16, 64, 100, 1000])
        groups = micro_batch_rows(lengths, budget)
        assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
        for g in groups:
            assert len(g) == 1 or len(g) * max(lengths[r] for r in g) <= budget
            assert all(2 * lengths[r] >= max(lengths[r] for r in g) for r in g)   # padding <= half
        flat = [lengths[r] for g in groups for r in g]
        assert flat == sorted(flat, reverse=True)  # longest first, so neighbours have similar widths
    assert micro_batch_rows([5, 3, 7], 0) == [[0, 1, 2]]  # 0: the whole batch, in order
    assert micro_batch_rows(LENGTHS, BUDGET) == [[0], [2], [6], [4], [7, 3], [1, 5]]


def test_a_row_longer_than_the_budget_forms_its_own_micro_batch():
    assert micro_batch_rows([10, 500, 12, 9], 40) == [[1], [2, 0, 3]]
    assert micro_batch_rows([10, 500, 12, 9], 10_000) == [[1], [2, 0, 3]]   # 500 and 12 never share a pass
    assert micro_batch_rows([500], 40) == [[0]]


def test_select_trims_to_the_longest_selected_row():
    from sao_core.rollout.trajectory import Trajectory

    rows = [Trajectory(id=str(n), prompt_id="p", env="e", token_ids=list(range(1, n + 1)), action_mask=[1] * n,
                       rollout_logprobs=[-0.5] * n, versions=[0] * n, reward=float(n), num_turns=1,
                       finish_reason="stop") for n in (9, 3, 5)]
    batch = collate(rows, pad_id=0)
    part = batch.select([2, 1])
    assert part.input_ids.shape == (2, 5) and [t.id for t in part.trajectories] == ["5", "3"]
    assert part.rewards.tolist() == [5.0, 3.0] and part.attention_mask.sum().item() == 8
    assert torch.equal(part.input_ids[0], batch.input_ids[2, :5])


def test_micro_batch_tokens_is_validated():
    with pytest.raises(ValueError, match="RLConfig.micro_batch_tokens must be >= 0, got -1"):
        RLConfig(data="d", output="o", micro_batch_tokens=-1).validate()
    RLConfig(data="d", output="o", micro_batch_tokens=0).validate()
    assert RLConfig(data="d", output="o").micro_batch_tokens == 16384


# ----------------------------------------------------------------------------------------------- exactness
def assert_same_step(whole, micro, *, atol: float = 2e-5, moved: float = 5e-4):
    """Same metrics (rel 1e-4) and weights (abs `atol`); the weights moved by far more than `atol`.

    2e-5 (of a 1e-3 movement): the tied embedding / LM-head weight's gradient is a sum over positions in
    which large terms cancel; micro-batches sum them in another order, and Adam's normalisation turns that
    float32 rounding into up to ~1.3e-5 of weight difference after two steps with whitened advantages."""
    (m_whole, p_whole, c_whole, initial), (m_micro, p_micro, c_micro, _) = whole, micro
    for a, b in zip(m_whole, m_micro, strict=True):
        assert set(a) == set(b)
        for name, value in a.items():
            assert b[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    movement = max(float((p_whole[k] - initial[k]).abs().max()) for k in initial)
    assert movement > moved
    diff = max(float((p_whole[k] - p_micro[k]).abs().max()) for k in p_whole)
    assert diff < atol, (diff, movement)
    if c_whole is not None:
        assert max(float((c_whole[k] - c_micro[k]).abs().max()) for k in c_whole) < atol
        # The value head starts at zero; after two steps of K = 2 it has moved.
        assert float(c_whole["value_head.weight"].abs().max()) > moved


@pytest.mark.parametrize("method, whiten", [("sao", False), ("sao", True), ("grpo_dis", False), ("grpo", False)])
def test_micro_batched_step_equals_the_whole_batch_step(method, whiten, tiny_model_dir):
    """Two steps with micro_batch_tokens=0 (one padded [8, 150] pass) and with 6 micro-batches: grad norms,
    losses, DIS / clip fractions, entropy, logp-diff max, explained variance and the weights agree."""
    whole = run_steps(tiny_model_dir, method, 0, whiten)
    micro = run_steps(tiny_model_dir, method, BUDGET, whiten)
    assert len(micro_batch_rows(LENGTHS, BUDGET)) >= 3
    assert_same_step(whole, micro)
    first = whole[0][0]
    assert first["policy_grad_norm"] > 0.1 and first["action_tokens"] == sum(n - 5 - 6 * (n > 25) for n in LENGTHS)
    if method == "sao":
        assert whole[0][1]["explained_variance"] != 0.0  # the second step sees a trained critic


# test_two_rank_micro_batched_step_equals_the_single_process_step (the 2-rank torchrun step with a filler pass)
# moved to test_learner_distributed.py: one torchrun launch there serves it and that file's other two-rank tests.
