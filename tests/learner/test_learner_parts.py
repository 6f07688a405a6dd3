"""The learner in parts (sao_core/learner/learner.py, state.py), each tested without a rollout service on a
recorded batch: a step, a publish (to a push function that records what it is handed), a checkpoint, a resume
from it, and a resume that replays a recorded journal to the same weights. The embedded tiny model is built
once per session (model_fixtures); each test below runs in well under 2 s on it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from sao_core import storage
from sao_core.learner import journal
from sao_core.learner.config import RLConfig
from sao_core.learner.errors import LearnerError
from sao_core.learner.learner import Learner
from sao_core.learner.state import RunCounters, RunState
from sao_core.rollout.trajectory import Trajectory
from sao_core.training.distributed import DistContext


def _recorded_batch(version: int = 0) -> list[Trajectory]:
    """Four trajectories as a rollout service delivers them (stream positions 0..3, two rewarded)."""
    rows = []
    for i in range(4):
        prompt, action = [5 + i, 6, 7, 8], [9 + i, 10, 11, 12, 13]
        rows.append(Trajectory(id=f"t{i}", prompt_id=f"p{i}", env="tool_arith", token_ids=prompt + action,
                               action_mask=[0] * 4 + [1] * 5, rollout_logprobs=[0.0] * 4 + [-2.5] * 5,
                               versions=[-1] * 4 + [version] * 5, reward=float(i % 2), num_turns=1,
                               finish_reason="stop", metadata={"epoch": 0, "position": i}))
    return rows


def _config(output: Path, cache: Path, **kw) -> RLConfig:
    base = dict(data=str(output / "unused-data"), output=str(output), batch_size=4, policy_lr=1e-3, critic_lr=1e-3,
                critic_warmup_steps=0, critic_updates=1, max_new_tokens_per_turn=8, max_total_tokens=64,
                keep_weight_versions=1, cache_dir=str(cache))
    return RLConfig(**{**base, **kw})


def _learner(tmp_path: Path, sao_cache, name: str = "run", **kw) -> Learner:
    scratch = tmp_path / f"scratch-{name}"
    scratch.mkdir(exist_ok=True)
    return Learner.load(_config(tmp_path / name, sao_cache, **kw), DistContext(), scratch)


def _weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.policy.state_dict().items()}


@pytest.fixture(autouse=True)
def _model(tiny_model_dir):
    """The embedded model is built (once per session) before any test here is timed."""


def _on_policy(learner: Learner, batch: list[Trajectory]) -> list[Trajectory]:
    """`batch` with the rollout log-probs the learner's own policy gives (as an engine at its version would):
    DIS keeps every token, so the step has a gradient."""
    from sao_core.objectives.common import token_logprobs

    for t in batch:
        ids = torch.tensor([t.token_ids])
        with torch.no_grad():
            logprobs = token_logprobs(learner.policy(ids).logits, ids)[0]
        t.rollout_logprobs = [0.0 if m == 0 else float(lp) for m, lp in zip(t.action_mask, logprobs, strict=True)]
    return batch


def test_a_step_trains_the_policy_and_advances_the_run_state(tmp_path, sao_cache):
    learner = _learner(tmp_path, sao_cache)
    before = _weights(learner)
    result = learner.step(_on_policy(learner, _recorded_batch()))
    assert result.changed and result.trained_at_version == 0 and result.tokens == 4 * 5
    assert result.staleness == Counter({0: 4})
    state = learner.state
    assert (state.step, state.version) == (1, 1)
    assert all(state.ledger.is_settled(p) for p in range(4)) and state.ledger.low_water_mark == 4
    assert state.ledger.outcomes["trained"] == 4 and state.ledger.owed_count() == 0
    assert state.counters.trained_trajectories == 4 and state.counters.trained_tokens == 20
    assert state.counters.first_rewards == [0.0, 1.0, 0.0, 1.0]
    after = _weights(learner)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the policy did not change"
    assert {"policy_loss", "token_lag_max", "tokens_beyond_bound"} <= set(result.metrics)


def test_critic_warmup_steps_leave_the_version(tmp_path, sao_cache):
    learner = _learner(tmp_path, sao_cache, critic_warmup_steps=2)
    result = learner.step(_recorded_batch())
    assert not result.changed and (learner.state.step, learner.state.version) == (1, 0)


def test_publish_writes_a_verified_version_hands_it_to_push_and_prunes_old_ones(tmp_path, sao_cache):
    learner = _learner(tmp_path, sao_cache)
    pushed = []
    learner.publish(lambda version, uri, digest, probe: pushed.append((version, uri, digest)))
    learner.step(_recorded_batch())
    learner.publish(lambda version, uri, digest, probe: pushed.append((version, uri, digest)))
    weights = tmp_path / "run" / "weights"
    assert [v for v, _, _ in pushed] == [0, 1]
    assert pushed[1][1] == str(weights / "v000001") and pushed[1][2] == storage.checkpoint_digest(pushed[1][1])
    assert sorted(p.name for p in weights.iterdir()) == ["v000001"], "keep_weight_versions=1 keeps the newest only"
    storage.verify_checkpoint(pushed[1][1])


def test_a_push_that_fails_stops_the_publish_before_pruning(tmp_path, sao_cache):
    learner = _learner(tmp_path, sao_cache)
    learner.publish()

    def refuse(version, uri, digest, probe):
        raise LearnerError(f"rollout service http://x refused version {version}")

    learner.step(_recorded_batch())
    with pytest.raises(LearnerError, match="refused version 1"):
        learner.publish(refuse)
    assert (tmp_path / "run" / "weights" / "v000000").exists(), "an unconfirmed push must not prune v0"


def test_checkpoint_then_resume_gives_back_the_weights_and_the_run_state(tmp_path, sao_cache):
    first = _learner(tmp_path, sao_cache)
    first.step(_recorded_batch())
    first.state.counters.dropped_by_reason["stale"] += 2
    uri = first.checkpoint(more_dropped=Counter({"no_action_tokens": 1}), more_requeued=3)
    assert uri.endswith("checkpoints/step-000001")
    stored = json.loads((Path(uri) / "trainer_state.json").read_text())
    assert stored["counters"]["dropped_by_reason"] == {"stale": 2, "no_action_tokens": 1}
    assert stored["counters"]["requeued"] == 3 and stored["stream"] == first.state.ledger.to_state()

    second = _learner(tmp_path, sao_cache)    # same output: a restarted process
    state = second.resume(uri)
    assert (state.step, state.version) == (1, 1) and state.ledger.to_state() == first.state.ledger.to_state()
    assert state.counters.requeued == 3 and state.counters.trained_tokens == 20
    assert all(torch.equal(a, b) for a, b in zip(_weights(first).values(), _weights(second).values(), strict=True))


def test_resume_refuses_another_methods_checkpoint(tmp_path, sao_cache):
    uri = _learner(tmp_path, sao_cache).checkpoint()
    other = _learner(tmp_path, sao_cache, method="grpo_dis")
    with pytest.raises(LearnerError, match="belongs to a 'sao' run, not 'grpo_dis'"):
        other.resume(uri)


def test_resume_replays_a_recorded_journal_to_the_same_weights(tmp_path, sao_cache):
    """A learner checkpoints at step 0, trains a step and journals it, then "crashes": a new learner resumes
    from the checkpoint and replays the journal to exactly the weights and state the first one reached."""
    torch.manual_seed(0)
    first = _learner(tmp_path, sao_cache)
    uri = first.checkpoint()
    batch = _recorded_batch()
    result = first.step(batch)
    journal.write_step(first.config.output, first.state.step, result.trained_at_version, batch)
    journal.write_drops(first.config.output, 1, 0, [{"id": "gone", "position": 4, "sample_index": 0, "attempt": 0,
                                                      "reason": "stale", "requeue": False}])

    torch.manual_seed(1)   # the replay does not depend on the new process's random state
    second = _learner(tmp_path, sao_cache)
    second.resume(uri)
    replayed = second.replay_journal()
    assert replayed.steps == 1 and replayed.trained_ids == ["t0", "t1", "t2", "t3"]
    assert replayed.dropped_ids == ["gone"] and replayed.drop_records == 1
    assert replayed.records[0]["replayed"] is True and replayed.records[0]["step"] == 1
    state = second.state
    assert (state.step, state.version) == (1, 1) and state.ledger.low_water_mark == 5
    assert dict(state.ledger.outcomes) == {"trained": 4, "stale": 1}
    assert state.counters.dropped_by_reason == Counter({"stale": 1})
    assert all(torch.equal(a, b) for a, b in zip(_weights(first).values(), _weights(second).values(), strict=True))


def test_a_tampered_journal_entry_stops_the_replay_naming_it(tmp_path, sao_cache):
    learner = _learner(tmp_path, sao_cache)
    uri = learner.checkpoint()
    journal.write_step(learner.config.output, 1, 0, _recorded_batch())
    entry = Path(journal.step_uri(learner.config.output, 1))
    entry.write_text(entry.read_text().replace('"reward":1.0', '"reward":9.0', 1))
    again = _learner(tmp_path, sao_cache)
    again.resume(uri)
    with pytest.raises(LearnerError, match=r"cannot resume .*step-000001"):
        again.replay_journal()


def test_run_state_round_trips_through_its_checkpoint_form():
    state = RunState(step=7, version=5, counters=RunCounters(trained_trajectories=28, requeued=1))
    state.ledger.train_piece(0, 0, True)
    state.settle_drops([{"position": 1, "reason": "group", "requeue": False},
                        {"position": 1, "reason": "stale", "requeue": False},
                        {"position": 2, "reason": "stale", "requeue": True}])
    assert state.ledger.is_settled(1) and state.ledger.outcome(2) is None   # re-queued: still owed
    assert dict(state.ledger.outcomes) == {"trained": 1, "stale": 1}   # the group's own reason, counted once
    back = RunState.from_checkpoint(state.to_checkpoint("sao", {}, {}), batch_size=4)
    assert (back.step, back.version, back.counters, back.ledger.to_state()) == \
        (7, 5, state.counters, state.ledger.to_state())
    old = RunState.from_checkpoint({"step": 3, "version": 2, "data_position": 12}, batch_size=4)
    assert old.counters.trained_trajectories == 12 and old.ledger.low_water_mark == 12


def test_checkpoints_beyond_keep_checkpoints_are_deleted_after_a_newer_one_is_complete(tmp_path, sao_cache):
    learner = _learner(tmp_path, sao_cache, keep_checkpoints=2, pin_checkpoints=(1,))
    for _ in range(4):
        learner.step(_recorded_batch())
        learner.checkpoint()
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step-000001", "step-000003", "step-000004"]   # the newest 2 and the pinned 1


def test_the_scratch_folder_is_named_by_run_and_a_stale_one_of_the_same_run_is_swept(tmp_path, monkeypatch):
    """Issue 31: a SIGKILLed learner leaves $TMPDIR/sao-learner-<run>-rank<N>; the next process of the same run
    removes it before using the folder, and leaves other runs' folders alone."""
    import tempfile

    from sao_core.learner.learner import run_key, run_scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = run_scratch("s3://b/run-a", 0)
    (stale / "weights").mkdir()
    (stale / "weights" / "model.safetensors").write_bytes(b"x" * 1024)   # what the killed process staged
    other = run_scratch("s3://b/run-b", 0)
    (other / "keep").write_text("another run's")
    again = run_scratch("s3://b/run-a", 0)
    assert again == stale == tmp_path / f"sao-learner-{run_key('s3://b/run-a')}-rank0"
    assert list(again.iterdir()) == [] and (other / "keep").read_text() == "another run's"
    assert run_scratch("s3://b/run-a", 1) != again      # ranks of one node do not share it


def test_a_lora_learner_trains_only_the_adapter_and_publishes_the_adapter_alone(tmp_path, sao_cache):
    """Issue 29: with lora_rank the policy trains an adapter (SAO's critic fully); a published version is the
    adapter alone in peft's format (lora_publish adapter, the default) or the merged model under the base names
    (lora_publish merged); the push gets a delivery probe of the version; a resume gives the weights back."""
    from safetensors.torch import load_file

    from sao_core.training.lora import is_adapter_dir

    learner = _learner(tmp_path, sao_cache, lora_rank=4, lora_target_modules="all-linear")
    frozen = {n: p.detach().clone() for n, p in learner.policy.named_parameters() if not p.requires_grad}
    learner.step(_on_policy(learner, _recorded_batch()))
    learner.step(_on_policy(learner, _recorded_batch(version=1)))
    assert all(torch.equal(frozen[n], p.detach()) for n, p in learner.policy.named_parameters() if n in frozen)
    assert any(p.requires_grad for p in learner.critic.parameters())
    pushed = []
    learner.publish(lambda version, uri, digest, probe: pushed.append((uri, probe)))
    uri, probe = pushed[0]
    assert is_adapter_dir(uri) and storage.read_manifest(uri)["metadata"]["kind"] == "lora_adapter"
    adapter = load_file(f"{uri}/adapter_model.safetensors")
    assert adapter and all(".lora_" in k for k in adapter)
    assert sum(v.numel() for v in adapter.values()) == sum(p.numel() for p in learner.policy.parameters()
                                                            if p.requires_grad)
    assert probe.version == learner.state.version == 2 and len(probe.logprobs) == 32
    uri = learner.checkpoint()
    again = _learner(tmp_path, sao_cache, lora_rank=4, lora_target_modules="all-linear")
    again.resume(uri)
    assert all(torch.equal(a, b) for a, b in zip(_weights(learner).values(), _weights(again).values(), strict=True))
    merged = _learner(tmp_path, sao_cache, name="merged", lora_rank=4, lora_publish="merged")
    merged.publish(lambda version, uri, digest, probe: pushed.append((uri, probe)))
    weights = load_file(f"{pushed[-1][0]}/model.safetensors")
    assert weights and not any("lora" in k or k.startswith("base_model") for k in weights)
