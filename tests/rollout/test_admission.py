"""The admission policy in isolation (rollout/admission.py), the plan model it travels in, and the pieces of
fragment training that need no live service: truncated GAE, the critic's bootstrap value, the ledger of pieces,
pending's ordering, the audit and the per-token lag metrics."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from sao_core import storage
from sao_core.learner import journal
from sao_core.learner.config import RLConfig
from sao_core.learner.lag import lag_record, percentile, token_lags
from sao_core.learner.ledger import FRAGMENT_LOST, TRAINED, StreamLedger
from sao_core.learner.pending import Pending
from sao_core.objectives.gae import adaptive_lambda, skip_observation_gae
from sao_core.rollout.admission import RULES, AdmissionError, AdmissionPolicy, check_method
from sao_core.rollout.manager import RolloutError, RolloutPlan
from sao_core.rollout.trajectory import Trajectory


def _piece(tid: str, position: int, versions: list[int], *, fragment: int | None = None, last: bool = True,
           reward: float = 1.0, turns: int = 1) -> Trajectory:
    """A piece with two context tokens and one action token per entry of `versions`."""
    n = len(versions)
    metadata = {"position": position, "epoch": 0, "admitted_version": min(versions), "attempt": 0}
    if fragment is not None:
        metadata["fragment"] = fragment
    return Trajectory(id=tid, prompt_id=f"p{position}", env="tool_arith", token_ids=[1, 2] + [3] * n,
                      action_mask=[0, 0] + [1] * n, rollout_logprobs=[0.0, 0.0] + [-0.5] * n,
                      versions=[-1, -1] + versions, reward=reward if last else 0.0, num_turns=turns,
                      finish_reason="stop" if last else "fragment", metadata=metadata)


# ---------------------------------------------------------------------------------------------- the policy
def test_each_rule_says_what_it_drops_orders_requeues_and_cuts():
    S = 4
    expect = {  # rule: (drops stale, order, requeues, fragments, abandon_after)
        "window": (True, "arrival", False, False, 4), "version_order": (True, "admission", False, False, 4),
        "requeue": (True, "arrival", True, False, 4), "no_drop": (False, "arrival", False, False, 16),
        "fragments": (False, "oldest_token", False, True, 16)}
    assert set(expect) == set(RULES)
    for rule, (drops, order, requeues, fragments, abandon) in expect.items():
        policy = AdmissionPolicy(rule, S, 80)
        policy.validate()
        assert (policy.drops_stale, policy.order, policy.requeues, policy.fragments, policy.abandon_after) == \
            (drops, order, requeues, fragments, abandon), rule
        # A dropping rule drops a trajectory whose oldest token lags S + 1; the others only past the safety bound.
        assert policy.too_stale(S + 1) == drops and not policy.too_stale(S)
        assert policy.too_stale(abandon + 1) and not policy.too_stale(abandon)
        assert policy.abandon_due(oldest_untrained=10, current=10 + abandon + 1)
        assert not policy.abandon_due(oldest_untrained=10, current=10 + abandon)
    fragments = AdmissionPolicy("fragments", S, 80)
    assert fragments.fragment_after == 2 and fragments.backlog_cap is None          # B unknown
    assert AdmissionPolicy("fragments", S, 80, batch_size=16).backlog_cap == 16   # (S - S // 2 - 1)·B
    assert AdmissionPolicy("fragments", 1, 8, batch_size=8).backlog_cap == 8      # never below one batch
    assert AdmissionPolicy("no_drop", S, 80, batch_size=16).backlog_cap is None
    assert [fragments.fragment_due(5, current) for current in (5, 6, 7, 8)] == [False, False, True, True]
    assert not AdmissionPolicy("no_drop", S, 80).fragment_due(0, 100)
    assert AdmissionPolicy("fragments", 1, 8).fragment_after == 1 and AdmissionPolicy("fragments", 0, 8).fragment_after == 1
    assert AdmissionPolicy("no_drop", 4, 8, hard_staleness=6).abandon_after == 6
    assert AdmissionPolicy("no_drop", 0, 8).abandon_after == 1        # never 0: a safety bound, not a rule


@pytest.mark.parametrize("fields, match", [
    ({"rule": "fifo"}, "admission must be one of window, version_order, requeue, no_drop, fragments, got 'fifo'"),
    ({"max_staleness": -1}, "max_staleness must be an integer >= 0 .versions., got -1"),
    ({"max_staleness": True}, "max_staleness must be an integer"),
    ({"max_in_flight": 0}, "max_in_flight must be an integer >= 1 .episodes., got 0"),
    ({"hard_staleness": 2}, r"hard_staleness \(2\) must be 0 \(auto\) or >= max_staleness \(4\)"),
])
def test_bad_policy_settings_are_named(fields, match):
    with pytest.raises(AdmissionError, match=match):
        AdmissionPolicy(**{"rule": "window", "max_staleness": 4, "max_in_flight": 8, **fields}).validate()


def test_fragments_need_a_critic():
    check_method(AdmissionPolicy("fragments"), "sao")
    for method in ("grpo", "grpo_async", "grpo_dis", "running_mean"):
        with pytest.raises(AdmissionError, match=f"needs a learned critic .*'{method}' trains whole episodes"):
            check_method(AdmissionPolicy("fragments"), method)
        check_method(AdmissionPolicy("no_drop"), method)
    with pytest.raises(ValueError, match="RLConfig.admission 'fragments' needs a learned critic"):
        RLConfig(data="u", output="u", method="grpo_async", admission="fragments").validate()


def test_the_run_config_and_the_plan_build_the_same_policy():
    config = RLConfig(data="u", output="u", batch_size=8, max_staleness=3, admission="fragments", hard_staleness=9)
    policy = config.admission_policy(services=2)
    assert policy == AdmissionPolicy("fragments", 3, 16, 9, 8)
    plan = RolloutPlan(dataset="x", max_in_flight=policy.max_in_flight, max_staleness=policy.max_staleness,
                       admission=policy.rule, hard_staleness=policy.hard_staleness, batch_size=policy.batch_size)
    assert plan.policy() == policy
    assert RolloutPlan(dataset="x").policy() is None        # no learner bound: nothing abandoned or cut
    with pytest.raises(RolloutError, match="plan.admission must be one of"):
        RolloutPlan(dataset="x", admission="fifo").validate()


def test_the_http_plan_model_is_checked_against_the_rollout_plan():
    """One plan model: the HTTP request (pydantic) has exactly RolloutPlan's fields with the same defaults, and
    the run's default rule is the plan's."""
    from sao_core.rollout.service import PlanRequest

    plan_fields = {f.name: f for f in dataclasses.fields(RolloutPlan)}
    assert set(PlanRequest.model_fields) == set(plan_fields)
    for name, field in plan_fields.items():
        if name == "dataset":           # required in both
            assert PlanRequest.model_fields[name].is_required() and field.default is dataclasses.MISSING
            continue
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        assert PlanRequest.model_fields[name].get_default(call_default_factory=True) == default, name
    assert RLConfig(data="u", output="u").admission == RolloutPlan(dataset="x").admission
    assert PlanRequest(dataset="x", admission="fragments", max_staleness=2).model_dump()["admission"] == "fragments"


# ---------------------------------------------------------------------------------------------- truncated GAE
def _hand_gae(rewards_last: float, values: list[float], bootstrap: float, gamma: float, lam: float) -> list[float]:
    """GAE over a row's action values in plain Python: the reward on the last action, `bootstrap` after it."""
    n = len(values)
    out, running = [0.0] * n, 0.0
    for k in range(n - 1, -1, -1):
        nxt = bootstrap if k == n - 1 else values[k + 1]
        reward = rewards_last if k == n - 1 else 0.0
        running = reward + gamma * nxt - values[k] + gamma * lam * running
        out[k] = running
    return out


def test_a_fragment_bootstraps_from_the_value_at_its_cut():
    values = torch.tensor([[0.0, 0.1, 0.3, 0.0, 0.5, 0.0], [0.0, 0.2, 0.4, 0.0, 0.6, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 1, 1, 0, 1, 0]])
    rewards = torch.tensor([0.0, 1.0])              # row 0 a fragment (reward 0), row 1 a whole episode
    bootstrap = torch.tensor([0.7, 0.0])
    lam = adaptive_lambda(mask.sum(dim=1), 1.5)
    adv, ret = skip_observation_gae(rewards, values, mask, 0.9, lam, bootstrap)
    for row, (reward, boot) in enumerate(((0.0, 0.7), (1.0, 0.0))):
        action_values = [float(v) for v, m in zip(values[row], mask[row], strict=True) if m]
        hand = _hand_gae(reward, action_values, boot, 0.9, float(lam[row]))
        assert adv[row][mask[row].bool()].tolist() == pytest.approx(hand, abs=1e-6)
        assert ret[row][mask[row].bool()].tolist() == pytest.approx([a + v for a, v in zip(hand, action_values,
                                                                                           strict=True)], abs=1e-6)
    # Without a bootstrap the fragment row would be treated as an episode that ended with reward 0.
    plain, _ = skip_observation_gae(rewards, values, mask, 0.9, lam)
    assert plain[0, 4] == pytest.approx(-0.5) and adv[0, 4] == pytest.approx(0.9 * 0.7 - 0.5)
    assert torch.equal(plain[1], adv[1])


def test_the_critic_values_a_fragments_cut_and_its_targets_match_a_hand_computation(tiny_model_dir):
    """A real critic: the bootstrap the updater reads (the extra position `collate` gives a fragment) equals
    the value head on the last hidden state of the fragment alone, and the advantages and critic targets of a
    fragment row equal the hand computation with it."""
    from sao_core.learner.batch import collate
    from sao_core.learner.updates import sao_targets
    from sao_core.models.value import ValueModel

    torch.manual_seed(0)
    critic = ValueModel.from_pretrained(tiny_model_dir).eval()
    torch.nn.init.normal_(critic.value_head.weight, std=0.2)
    fragment = Trajectory(id="e-f0", prompt_id="p", env="tool_arith", token_ids=[5, 6, 7, 8, 9, 10, 11],
                          action_mask=[0, 0, 1, 1, 0, 0, 0], rollout_logprobs=[0, 0, -0.1, -0.2, 0, 0, 0],
                          versions=[-1, -1, 0, 0, -1, -1, -1], reward=0.0, num_turns=1, finish_reason="fragment",
                          metadata={"fragment": 0})
    whole = Trajectory(id="w", prompt_id="q", env="tool_arith", token_ids=[5, 6, 7, 8, 9],
                       action_mask=[0, 0, 1, 1, 1], rollout_logprobs=[0, 0, -0.1, -0.2, -0.3],
                       versions=[-1, -1, 0, 0, 0], reward=1.0, num_turns=1, finish_reason="stop")
    batch = collate([fragment, whole], pad_id=0)
    assert batch.input_ids.shape[1] == 8 and batch.attention_mask[0].tolist() == [1] * 8
    with torch.no_grad():
        values = critic(batch.input_ids, batch.attention_mask)
        hidden = critic.backbone(input_ids=torch.tensor([fragment.token_ids]), use_cache=False).last_hidden_state
        expected_cut = float(critic.value_head(hidden[0, -1].float()))
    config = RLConfig(data="u", output="u", gamma=1.0, lambda_alpha=1.5)
    advantages, returns, bootstrap = sao_targets(batch, values, config)
    assert float(bootstrap[0]) == pytest.approx(expected_cut, abs=1e-5) and float(bootstrap[1]) == 0.0
    action_values = [float(values[0, 2]), float(values[0, 3])]
    lam = 1 - 1 / (1.5 * 2)
    hand = _hand_gae(0.0, action_values, expected_cut, 1.0, lam)
    assert advantages[0, 2:4].tolist() == pytest.approx(hand, abs=1e-5)
    targets = _hand_gae(0.0, action_values, expected_cut, 1.0, 1.0)
    assert returns[0, 2:4].tolist() == pytest.approx([t + v for t, v in zip(targets, action_values, strict=True)],
                                                     abs=1e-5)
    assert returns[0, 2:4].tolist() == pytest.approx([expected_cut, expected_cut], abs=1e-5)  # λ = 1: V(cut)
    assert float(returns[1, 4]) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------- ledger, pending
def test_the_ledger_settles_a_fragmented_position_when_every_piece_is_trained_in_any_order():
    ledger = StreamLedger()
    assert not ledger.train_piece(0, 1, last=False)
    assert ledger.has_piece(0, 1) and not ledger.has_piece(0, 0) and ledger.partial(0, 1) == [0]
    assert not ledger.train_piece(0, 2, last=True)          # piece 0 is still missing
    restored = StreamLedger.from_state(json.loads(json.dumps(ledger.to_state())))
    assert restored.pieces == ledger.pieces
    assert ledger.train_piece(0, 0, last=False) and ledger.is_settled(0) and ledger.partial(0, 1) == []
    assert ledger.train_piece(1, 0, last=True) and ledger.is_settled(1)   # an episode delivered whole
    assert ledger.outcomes == {TRAINED: 2}
    ledger.train_piece(3, 0, last=False)
    assert ledger.settle(3, FRAGMENT_LOST) and ledger.pieces == {} and ledger.outcome(3) == FRAGMENT_LOST


def test_pending_acks_a_redelivered_piece_and_orders_by_the_oldest_untrained_token():
    config = RLConfig(data="u", output="u", batch_size=2, max_staleness=4, admission="fragments")
    ledger = StreamLedger()
    ledger.train_piece(0, 0, last=False)
    pending = Pending(config, ledger)
    trained, dropped = pending.add([(_piece("a-f0", 0, [3], fragment=0, last=False), 0),
                                    (_piece("a", 0, [5, 6], fragment=1), 0),
                                    (_piece("b", 1, [7]), 0), (_piece("c", 2, [4]), 0)])
    assert trained == {0: ["a-f0"]} and dropped == {}
    assert [t.id for t, _ in pending.batch(oldest_token=True)] == ["a", "c"]       # versions 5 and 4 before 7
    # Nothing is dropped for age below the safety bound (4 S = 16); past it the piece goes.
    assert pending.drop_unusable(version=7 + 16) == []
    assert [d.reason for d in pending.drop_unusable(version=7 + 17)] == ["stale"]


def test_no_drop_keeps_what_window_drops():
    for rule, dropped in (("window", ["stale"]), ("no_drop", [])):
        pending = Pending(RLConfig(data="u", output="u", batch_size=1, max_staleness=2, admission=rule),
                          StreamLedger())
        pending.add([(_piece("a", 0, [0, 1]), 0)])
        assert [d.reason for d in pending.drop_unusable(version=3)] == dropped


# ---------------------------------------------------------------------------------------------- audit, lag
def _checkpoint(out: Path, ledger: StreamLedger, step: int) -> None:
    staging = out / f"staging-{step}"
    staging.mkdir(parents=True)
    (staging / "trainer_state.json").write_text(json.dumps({"step": step, "stream": ledger.to_state()}))
    storage.publish_checkpoint(staging, str(out / "checkpoints" / f"step-{step:06d}"), metadata={"step": step})


def test_the_audit_checks_every_piece_of_a_fragmented_episode(tmp_path):
    ledger = StreamLedger()
    for position, index, last in ((0, 0, False), (1, 0, True), (0, 1, True), (2, 0, False)):
        ledger.train_piece(position, index, last)
    ledger.settle(2, FRAGMENT_LOST)
    good = {1: [_piece("a-f0", 0, [0], fragment=0, last=False), _piece("b", 1, [0])],
            2: [_piece("a", 0, [1], fragment=1), _piece("c-f0", 2, [1], fragment=0, last=False)]}
    lost = [{"id": "lost-2", "position": 2, "sample_index": 0, "attempt": 0, "reason": FRAGMENT_LOST,
             "requeue": False}]

    def run(name: str, steps: dict) -> dict:
        out = tmp_path / name
        journal.write_plan(str(out), 0, 0, 0, 1, {"start_position": 0, "skip_positions": []}, {})   # the first
        for step, pieces in steps.items():
            journal.write_step(str(out), step, step - 1, pieces)
        journal.write_drops(str(out), 2, 0, lost)
        _checkpoint(out, ledger, max(steps))
        return journal.audit(str(out))

    report = run("ok", good)
    assert report["ok"], report["problems"]
    assert report["fragmented_episodes"] == 1 and report["trained_positions"] == 2
    assert report["dropped_by_reason"] == {FRAGMENT_LOST: 1}
    report = run("missing", {1: [_piece("b", 1, [0])], 2: [_piece("a", 0, [1], fragment=1),
                                                            _piece("c-f0", 2, [1], fragment=0, last=False)]})
    assert not report["ok"] and report["missing_pieces"] == [(0, 0)]
    report = run("twice", {**good, 3: [_piece("a-f0", 0, [0], fragment=0, last=False)]})
    assert not report["ok"] and any("(0, 0, 0)" in p for p in report["problems"])


def test_lag_metrics_count_every_trained_token():
    pieces = [_piece("a", 0, [2, 2, 5], turns=6), _piece("b", 1, [6], turns=1),
              _piece("c-f0", 2, [1, 6], fragment=0, last=False, turns=3)]
    lags = token_lags(pieces, version=6)
    assert lags == {4: 2, 1: 1, 0: 2, 5: 1}
    assert percentile(lags, 0.5) == 1 and percentile(lags, 0.99) == 5
    record = lag_record(pieces, version=6, policy=AdmissionPolicy("window", max_staleness=4))
    assert record["token_lag"] == {"0": 2, "1": 1, "4": 2, "5": 1} and record["token_lag_max"] == 5
    assert record["tokens_beyond_bound"] == pytest.approx(1 / 6)
    assert record["token_lag_by_turns"] == {"1": 0.0, "3-4": 2.5, "5-8": 3.0}
    assert record["fragments"] == 1 and record["fragments_per_episode"] == 1.0
