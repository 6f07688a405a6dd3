"""Learning that holds (issue 25): training episodes seeded by their place in the prompt stream, batches in
stream order, and the turn-end health metrics (cut turns, end-of-turn log-prob, tool errors) from the episode
runner to metrics.jsonl."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rl_data import tool_arith_rl  # noqa: E402  (tests/rl_data.py: the one builder of prepared rl datasets)

from sao_core.envs.base import Task
from sao_core.envs.tool_arith import ToolArithEnv
from sao_core.learner.config import RLConfig
from sao_core.learner.health import turn_health, was_cut
from sao_core.learner.ledger import StreamLedger
from sao_core.learner.pending import Pending
from sao_core.rollout.client import RolloutClient
from sao_core.rollout.engines.base import SamplingParams
from sao_core.rollout.episode import EpisodeLimits, run_episode
from sao_core.rollout.manager import episode_seed
from sao_core.rollout.server import RolloutServer, ServeConfig
from sao_core.rollout.trajectory import Trajectory

EOT = 2   # the embedded tokenizer's <|im_end|>


def _trajectory(tid: str, position: int, *, admitted: int = 0, finish: str = "stop", last: int = EOT,
                info: dict | None = None, reward: float = 0.0) -> Trajectory:
    tokens = [10, 11, 12, last]
    return Trajectory(id=tid, prompt_id=f"p{position}", env="tool_arith", token_ids=tokens, action_mask=[0, 1, 1, 1],
                      rollout_logprobs=[0.0, -0.1, -0.2, -0.5], versions=[-1, 0, 0, 0], reward=reward, num_turns=1,
                      finish_reason=finish,
                      metadata={"position": position, "admitted_version": admitted, "info": info or {}})


def test_episode_seed_depends_on_the_stream_place_only():
    seeds = {episode_seed(7, p, k, a) for p in range(50) for k in range(4) for a in range(2)}
    assert len(seeds) == 400 and all(0 <= s < 2**31 for s in seeds)
    assert episode_seed(7, 3, 1, 0) == episode_seed(7, 3, 1, 0) != episode_seed(8, 3, 1, 0)


def test_a_batch_takes_the_lowest_positions_of_the_oldest_version_in_stream_order():
    """Arrival order (here reversed) decides neither which episodes of one admission version fill the batch nor
    the order of its rows."""
    config = RLConfig(data="u", output="u", batch_size=3)
    pending = Pending(config, StreamLedger())
    arrivals = [_trajectory(f"t{p}", p, admitted=0 if p < 5 else 1) for p in (7, 6, 4, 1, 3, 0, 2, 5)]
    pending.add([(t, 0) for t in arrivals])
    batch = pending.batch(oldest_first=True, admitted_at_most=1)
    assert [t.metadata["position"] for t, _ in batch] == [0, 1, 2]
    batch = pending.batch(oldest_first=True, admitted_at_most=1)
    assert [t.metadata["position"] for t, _ in batch] == [3, 4, 5]
    window = Pending(config, StreamLedger())      # the window rule takes arrivals in order, rows still sorted
    window.add([(t, 0) for t in arrivals])
    assert [t.metadata["position"] for t, _ in window.batch()] == [4, 6, 7]


def test_turn_health_counts_cut_turns_their_answers_end_of_turn_logprobs_and_tool_errors():
    batch = [
        _trajectory("a", 0, reward=1.0, info={"errors": 0}),                       # ended its turn
        _trajectory("b", 1, finish="length", last=40, info={"errors": 1, "cut_turn": True,
                                                            "cut_turn_correct": True}),   # cut at the cap
        _trajectory("c", 2, finish="length", last=41, info={"errors": 0, "cut_turn": True,
                                                            "cut_turn_correct": False}),
        _trajectory("d", 3, finish="length", info={"errors": 2}),                 # turn limit: ended on EOT
    ]
    assert [was_cut(t, (EOT,)) for t in batch] == [False, True, True, False]
    health = turn_health(batch, (EOT,))
    assert health == {"turn_cut_share": 0.5, "turn_cut_correct_share": 0.5, "end_of_turn_logprob": -0.5,
                      "tool_error_share": 0.5}
    assert turn_health([batch[0]], (EOT,)) == {"turn_cut_share": 0.0, "end_of_turn_logprob": -0.5,
                                               "tool_error_share": 0.0}
    assert turn_health([], (EOT,)) == {}


def test_tool_arith_grades_a_cut_turn_without_rewarding_it():
    env = ToolArithEnv()
    env.reset(Task(id="t", env="tool_arith", prompt=[{"role": "user", "content": "Compute 2 + 3"}], answer="5"))
    assert env.grade_unfinished("The answer is \\boxed{5}.}.}.}") is True
    assert env.grade_unfinished("The answer is \\boxed{6}.5") is False
    assert env.grade_unfinished("<tool_call><tool_call><tool_call>") is False
    env.reset(Task(id="u", env="tool_arith", prompt=[{"role": "user", "content": "Compute 2 + 3"}]))
    assert env.grade_unfinished("\\boxed{5}") is None


class _CapEngine:
    """Answers every turn with a fixed text cut at max_new_tokens (finish "length" when cut), like a real engine."""

    def __init__(self, tokenizer, text: str):
        self.tokenizer, self.text, self.version = tokenizer, text, 0

    async def generate(self, prompt_ids, params):
        from sao_core.rollout.engines.base import Generation

        ids = list(self.tokenizer.encode(self.text, add_special_tokens=False))
        cut = len(ids) > params.max_new_tokens
        ids = ids[:params.max_new_tokens] if cut else ids + [self.tokenizer.eos_token_id]
        return Generation(ids, [-0.1] * len(ids), [0] * len(ids), "length" if cut else "stop")


def test_the_episode_runner_records_whether_a_cut_turn_held_the_answer(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = Task(id="t", env="tool_arith", prompt=[{"role": "user", "content": "Compute 2 + 3"}], answer="5")

    def run(text: str, cap: int) -> Trajectory:
        return asyncio.run(run_episode(task, ToolArithEnv(), _CapEngine(tokenizer, text), tokenizer,
                                       SamplingParams(max_new_tokens=cap), EpisodeLimits(max_new_tokens_per_turn=cap)))

    cut = run("The answer is \\boxed{5}." + "}." * 40, cap=24)
    assert cut.finish_reason == "length" and cut.reward == 0.0
    assert cut.metadata["info"] == {"cut_turn": True, "cut_turn_correct": True}
    assert was_cut(cut, (tokenizer.eos_token_id,))
    ended = run("The answer is \\boxed{5}.", cap=24)
    assert ended.reward == 1.0 and "cut_turn" not in ended.metadata["info"]
    assert not was_cut(ended, (tokenizer.eos_token_id,))


def _dataset(root: Path, count: int) -> str:
    return tool_arith_rl(root / "rl", count, seed=4, p_more=1.0)


def _roll_out(server: RolloutServer, dataset: str, in_flight: int, consumer: str) -> dict[int, Trajectory]:
    client = RolloutClient(server.url, consumer=consumer)
    client.start({"dataset": dataset, "seed": 5, "max_in_flight": in_flight, "max_new_tokens_per_turn": 24,
                  "max_total_tokens": 160})
    got: dict[int, Trajectory] = {}
    for _ in range(200):
        items, info = client.take(max_items=16, wait_s=2.0)
        client.ack([t.id for t in items])
        got.update({t.metadata["position"]: t for t in items})
        if not items and info["plan_done"]:
            break
    client.stop()
    client.close()
    return got


def test_training_episodes_sample_the_same_tokens_whatever_else_runs_beside_them(warm_tool_model, sao_cache,
                                                                                  tmp_path):
    """The same plan rolled out one episode at a time and eight at once (other arrival orders, other requests
    sharing the engine's forward passes) samples the same tokens at every stream position: each episode's seed
    comes from its place in the stream (the engine's arrival counter seeded them before)."""
    dataset = _dataset(tmp_path, 8)
    server = RolloutServer(ServeConfig(model=warm_tool_model, port=0, cache_dir=str(sao_cache), max_batch=16)).start()
    try:
        alone = _roll_out(server, dataset, in_flight=1, consumer="one")
        together = _roll_out(server, dataset, in_flight=8, consumer="many")
    finally:
        server.stop()
    assert sorted(alone) == sorted(together) == list(range(8))
    for position, t in alone.items():
        assert t.metadata["sampling_seed"] == episode_seed(5, position, 0, 0)
        assert together[position].token_ids == t.token_ids, f"position {position}"
        assert together[position].rollout_logprobs == pytest.approx(t.rollout_logprobs, abs=1e-4)


def test_the_update_reports_its_end_of_turn_tokens(tiny_model_dir, sao_cache):
    """A real grpo_dis update on two groups of two: the end_of_turn_* metrics are the policy's log-prob of the
    sampled end-of-turn tokens, the share DIS kept (one recorded 2 nats too low: ratio e^2 = 7.4 > 1 + eps_high,
    masked) and their mean advantage (0: each group has one rewarded and one unrewarded turn end)."""
    import torch

    from sao_core.learner.batch import collate
    from sao_core.learner.updates import Updater
    from sao_core.models import load_model_and_tokenizer
    from sao_core.objectives.common import token_logprobs

    torch.manual_seed(0)
    policy, tok = load_model_and_tokenizer(tiny_model_dir, sao_cache)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Compute 2 + 3"}], tokenize=True,
                                     add_generation_prompt=True, return_dict=True)["input_ids"]
    eot = tok.eos_token_id
    actions = [tok.encode("The answer is \\boxed{5}.", add_special_tokens=False) + [eot],
               tok.encode("The answer is \\boxed{7}.", add_special_tokens=False) + [eot]]
    rows, end_logprobs = [], []
    for g in range(2):
        for k, (action, reward) in enumerate(zip(actions, (1.0, 0.0), strict=True)):
            ids = torch.tensor([prompt + action])
            with torch.no_grad():
                lps = token_logprobs(policy(input_ids=ids).logits, ids)[0, len(prompt):].tolist()
            end_logprobs.append(lps[-1])
            if g == 1 and k == 1:
                lps[-1] -= 2.0          # recorded 2 nats lower: ratio e^2 = 7.4 > 1 + eps_high
            rows.append(Trajectory(id=f"{g}{k}", prompt_id=f"p{g}", env="tool_arith", token_ids=prompt + action,
                                   action_mask=[0] * len(prompt) + [1] * len(action),
                                   rollout_logprobs=[0.0] * len(prompt) + lps,
                                   versions=[-1] * len(prompt) + [0] * len(action), reward=reward, num_turns=1,
                                   finish_reason="stop", metadata={"position": g}))
    config = RLConfig(data="u", output="u", method="grpo_dis", batch_size=4, group_size=2, policy_lr=1e-3)
    metrics, changed = Updater(config, policy, end_of_turn_ids=(eot,)).step(collate(rows, tok.pad_token_id), 0)
    assert changed
    assert metrics["end_of_turn_learner_logprob"] == pytest.approx(sum(end_logprobs) / 4, abs=1e-5)
    assert metrics["end_of_turn_kept"] == 0.75
    assert metrics["end_of_turn_advantage"] == pytest.approx(0.0, abs=1e-6)
    metrics, _ = Updater(config, policy).step(collate(rows, tok.pad_token_id), 0)
    assert not any(k.startswith("end_of_turn") for k in metrics)
