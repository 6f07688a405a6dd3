"""Evaluation during training (sao_core/learner/evaluation.py): held-out greedy and sampled rewards at the
current weights, asked of the colocated rollout service while its training stream goes on, on the embedded
model after a short SFT on single-call tool_arith (episodes of two turns: the calculator call, then the answer;
rewards not all 0)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from rl_data import prepared_rl  # noqa: E402  (tests/rl_data.py: the one builder of prepared rl datasets)

from sao_core.envs.tool_arith import tool_arith_tasks
from sao_core.learner.config import RLConfig
from sao_core.learner.loop import LearnerError, train_rl

EVAL_PROMPTS = 12
TOKEN = "eval-test-token-0123456789"


def _prepared(root: Path, name: str, tasks) -> str:
    return prepared_rl(root / name, tasks)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl-eval")
    train = _prepared(root, "train", tool_arith_tasks(200, seed=3, p_more=1.0))
    held_out = _prepared(root, "held_out", tool_arith_tasks(EVAL_PROMPTS, seed=4, p_more=1.0))
    return train, held_out


@pytest.fixture(scope="module")
def calling_model(tmp_path_factory, sao_cache):
    """SFT on single-call conversations stopped early: it calls the calculator, then answers (sampled reward
    about 0.25). The very recipe of test_learner.py's rl_warm_model, so that under `make test` (a shared
    $SAO_TEST_SHARED_DIR, model_fixtures.sft_model) one process trains it for both files; this file trained a
    recipe of its own before (150 steps on other rows, ~10 s)."""
    from model_fixtures import sft_model

    from sao_core.data.synthetic import tool_arith_sft_rows

    return sft_model(tmp_path_factory.mktemp("calling"), tool_arith_sft_rows(600, seed=5), sao_cache, steps=240,
                     max_tokens=128)


def _config(train, held_out, output, model, cache, **kw) -> RLConfig:
    base = dict(data=train, output=str(output), model=model, method="sao", steps=3, batch_size=8, policy_lr=3e-4,
                critic_lr=3e-4, critic_warmup_steps=1, max_new_tokens_per_turn=24, max_total_tokens=256,
                eval_every=2, eval_data=held_out, eval_samples=2, cache_dir=str(cache))
    return RLConfig(**{**base, **kw})


def test_evaluation_during_training_logs_held_out_rewards_of_the_current_weights(datasets, calling_model,
                                                                                 sao_cache, tmp_path):
    from sao_core.kfp.artifacts import training_markdown
    from sao_core.learner.evaluation import load_eval_set, play_rl
    from sao_core.rollout.engines.hf import HFEngine

    train, held_out = datasets
    config = _config(train, held_out, tmp_path / "run", calling_model, sao_cache)
    summary = train_rl(config)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if "eval_sampled_reward" in r]
    # At step 0 (a line of its own, before any update), every eval_every steps and at the last step (3 steps,
    # so the last is not one of the every-2 ones: both rules show; 4 steps before, where they coincided).
    assert [r["step"] for r in evaluated] == [0, 2, 3]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in evaluated:
        assert 0.0 <= r["eval_greedy_reward"] <= 1.0 and 0.0 <= r["eval_sampled_reward"] <= 1.0
        assert r["eval_prompts"] == EVAL_PROMPTS and r["eval_greedy_n"] == EVAL_PROMPTS
        assert r["eval_sampled_n"] == 2 * EVAL_PROMPTS and r["eval_failed"] == 0 and r["eval_s"] > 0
        assert "eval_other_versions" not in r
    # The summary carries the first and last values (KFP Metrics) and the history.
    assert summary["eval_sampled_reward_first"] == evaluated[0]["eval_sampled_reward"]
    assert summary["eval_greedy_reward_last"] == evaluated[-1]["eval_greedy_reward"]
    assert [h["step"] for h in summary["evaluations"]] == [0, 2, 3]
    # The KFP Markdown artifact: a table of the evaluations.
    page = training_markdown("sao", summary, rows, "reward_mean")
    table = page.split("## held-out evaluation during training")[1].split("##")[0]
    assert table.count("\n| 0 | 0 |") == 1 and f"| {evaluated[-1]['eval_greedy_reward']:.4g} |" in table

    # The episodes of the last evaluation: whole multi-turn episodes, all on the final weights version.
    last = json.loads((tmp_path / "run" / "eval" / "step-000003.json").read_text())
    assert last["version"] == summary["version"] and len(last["episodes"]) == 3 * EVAL_PROMPTS
    assert all(e["versions"] == [summary["version"]] for e in last["episodes"])
    assert min(e["turns"] for e in last["episodes"]) >= 2      # the tool call answered, the episode went on
    assert any(e["reward"] == 1.0 for e in last["episodes"]), last["episodes"][:3]   # not a vacuous 0

    # Recomputed directly: the published final model in a local engine, the same episodes (same seeds).
    async def again():
        engine = HFEngine(summary["model"], str(sao_cache), seed=0)
        try:
            return await play_rl(load_eval_set(config), engine, engine.tokenizer, config)
        finally:
            await engine.close()
    direct = {(e["kind"], e["id"], e["sample"]): e["reward"] for e in asyncio.run(again())}
    logged = {(e["kind"], e["id"], e["sample"]): e["reward"] for e in last["episodes"]}
    assert direct.keys() == logged.keys()
    # Same weights, same seeds: the same answers. The service batched them with training episodes, which
    # moves logits by float noise: a draw within that noise of a boundary may pick another token (at most
    # one episode here, as in test_engine_hf).
    assert sum(direct[k] != logged[k] for k in direct) <= 1
    mean = sum(v for (kind, _, _), v in direct.items() if kind == "greedy") / EVAL_PROMPTS
    assert abs(mean - evaluated[-1]["eval_greedy_reward"]) <= 1 / EVAL_PROMPTS + 1e-9


def test_evaluation_settings_are_checked_before_the_model_loads(datasets, sao_cache, tmp_path):
    train, held_out = datasets
    with pytest.raises(ValueError, match="eval_every needs eval_data"):
        RLConfig(data=train, output=str(tmp_path / "a"), eval_every=2).validate()
    with pytest.raises(ValueError, match="eval_samples >= 1 or eval_greedy"):
        RLConfig(data=train, output=str(tmp_path / "a"), eval_every=2, eval_data=held_out, eval_samples=0,
                 eval_greedy=False).validate()
    with pytest.raises(LearnerError, match="eval_data"):
        train_rl(_config(train, str(tmp_path / "missing"), tmp_path / "b", "embedded:tiny", sao_cache))
    sft = tmp_path / "sft"
    (sft).mkdir()
    (sft / "data.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (sft / "stats.json").write_text(json.dumps({"kind": "sft", "status": "ok", "rows_written": 1}))
    with pytest.raises(LearnerError, match="--kind sft"):
        train_rl(_config(train, str(sft), tmp_path / "c", "embedded:tiny", sao_cache))


def test_a_benchmark_is_evaluated_by_the_evaluator_through_the_service(tmp_path, sao_cache, tiny_model_dir):
    """eval_data = a benchmark name: `sao_core.eval.run.evaluate` with the service as its engine, its graders,
    its outputs per step; the bearer token is sent (the server refuses requests without it)."""
    from sao_core.learner.evaluation import ServiceEngine, TrainingEvaluator, load_eval_set
    from sao_core.models import load_tokenizer
    from sao_core.rollout.engines.base import EngineError
    from sao_core.rollout.server import RolloutServer, ServeConfig

    config = RLConfig(data="unused", output=str(tmp_path / "run"), model=tiny_model_dir, steps=3, eval_every=3,
                      eval_data="imo_answerbench", eval_limit=2, eval_samples=2, max_new_tokens_per_turn=8,
                      max_total_tokens=512, cache_dir=str(sao_cache))
    server = RolloutServer(ServeConfig(model=tiny_model_dir, port=0, cache_dir=str(sao_cache)), token=TOKEN).start()
    try:
        tokenizer = load_tokenizer(tiny_model_dir, str(sao_cache))
        anonymous = ServiceEngine([server.url], None, tokenizer)
        with pytest.raises(EngineError, match="401"):
            asyncio.run(anonymous.generate([1, 2, 3], _greedy()))
        anonymous.shutdown()
        metrics = TrainingEvaluator(config, load_eval_set(config), tokenizer, TOKEN).run([server.url], 3, 0)
    finally:
        server.stop()
    assert metrics["eval_prompts"] == 2 and metrics["eval_greedy_n"] == 2 and metrics["eval_sampled_n"] == 4
    assert metrics["eval_greedy_reward"] == 0.0 == metrics["eval_sampled_reward"]   # the base tiny model
    for kind, k in (("greedy", 1), ("sampled", 2)):
        folder = tmp_path / "run" / "eval" / "step-000003" / kind
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["benchmarks"]["imo_answerbench"]["samples"] == 2 * k
        assert summary["config"]["temperature"] == (0.0 if kind == "greedy" else 1.0)
        assert (folder / "report.html").is_file()


def _greedy():
    from sao_core.rollout.engines.base import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=4)


def test_each_turn_of_an_episode_samples_with_a_seed_of_its_own(calling_model, sao_cache):
    """run_episode (training rollouts, the evaluator, evaluation during training) gives turn t of a seeded
    episode the seed turn_seed(seed, t): with one fixed seed the HF engine would draw the same random numbers
    on every turn (it seeds a fresh generator per request). A real engine behind a recorder of the seeds."""
    from sao_core.envs.base import StepResult, Task
    from sao_core.rollout.engines.base import SamplingParams
    from sao_core.rollout.engines.hf import HFEngine
    from sao_core.rollout.episode import EpisodeLimits, run_episode, turn_seed

    class ThreeTurns:   # every turn gets the same tool answer, the episode ends after the third
        max_turns = 3

        def __init__(self):
            self.turns = 0

        def reset(self, task):
            return list(task.prompt)

        def step(self, action_text):
            self.turns += 1
            return StepResult(done=self.turns == 3, observation=None if self.turns == 3 else "ok", reward=0.0,
                              finish_reason="stop" if self.turns == 3 else None)

        def close(self):
            pass

    class Recorder:
        def __init__(self, engine):
            self.engine, self.seeds, self.outputs = engine, [], []

        def __getattr__(self, name):
            return getattr(self.engine, name)

        async def generate(self, ids, params):
            self.seeds.append(params.seed)
            out = await self.engine.generate(ids, params)
            self.outputs.append(out.token_ids)
            return out

    from sao_core.models import load_tokenizer

    tokenizer = load_tokenizer(calling_model, sao_cache)
    task = Task(id="t", env="x", prompt=[{"role": "user", "content": "Compute 17 + 25"}])

    async def episode(seed):
        engine = HFEngine(calling_model, str(sao_cache), seed=0)
        try:
            recorder = Recorder(engine)
            trajectory = await run_episode(task, ThreeTurns(), recorder, tokenizer,
                                           SamplingParams(max_new_tokens=48, seed=seed), EpisodeLimits(600, 48, 0.0))
            return trajectory, recorder
        finally:
            await engine.close()

    first, seen = asyncio.run(episode(7))
    again, seen_again = asyncio.run(episode(7))
    assert first.num_turns == 3 and seen.seeds == [7, turn_seed(7, 1), turn_seed(7, 2)]
    assert len(set(seen.seeds)) == 3 and all(0 <= s < 2**31 for s in seen.seeds)
    assert first.token_ids == again.token_ids and seen_again.seeds == seen.seeds     # reproducible
    assert turn_seed(None, 2) is None and turn_seed(7, 0) == 7
    _, unseeded = asyncio.run(episode(None))
    assert unseeded.seeds == [None, None, None]     # an unseeded episode leaves the draws to the engine
