"""The benchmarks in bench/: the simulator on cases with known answers, and smoke runs of every script with
tiny settings so that they cannot rot. No timing assertions: the numbers are measured by the scripts."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import simulator  # noqa: E402
from simulator import Episode, SimConfig, Workload, engine_params, simulate  # noqa: E402


class _Cycle(Workload):
    """Episodes in a fixed order (deterministic tests)."""

    def __init__(self, episodes: list[Episode]):
        super().__init__()
        self._it = itertools.cycle(episodes)

    def draw_turns(self, rng):
        return 1

    def draw(self, rng, turns):
        return next(self._it)


def _flat_engine(**kw) -> dict:
    # one token per step per sequence, every step 0.01 s whatever the batch: a sequence decodes at 100 tok/s
    return {"step_overhead_s": 0.01, "step_per_row_s": 0.0, "max_batch": 1024, **kw}


def test_constant_lengths_sync_and_async_are_equal_at_the_same_in_flight():
    episode = Episode([50, 50], [0.2], 120)
    common = dict(batch_size=8, trajectories=64, train_tokens_per_s_per_gpu=1e4, push_s=0.1, **_flat_engine())
    sync = simulate(SimConfig(method="sync", group_size=8, **common), _Cycle([episode]))
    sao = simulate(SimConfig(method="async", group_size=1, in_flight=8, **common), _Cycle([episode]))
    # per step: 0.5 s + 0.2 s + 0.5 s of episode, 8 x 120 / 1e4 s of training, 0.1 s push
    step = 1.2 + 8 * 120 / 1e4 + 0.1
    assert sync["wall_s"] == pytest.approx(8 * step)
    # the same barrier; async only overlaps the weight push with the next episodes (slots free at the ack,
    # generation is not paused), as the learner acknowledges before it pushes
    assert sao["wall_s"] == pytest.approx(sync["wall_s"] - 7 * 0.1)
    # ... so those episodes start on the old weights: one version stale in every step but the first
    assert sync["staleness_mean"] == 0 and sao["staleness_mean"] == pytest.approx(7 / 8) and sao["dropped"] == 0
    no_push = {**common, "push_s": 0.0}
    assert simulate(SimConfig(method="async", in_flight=8, **no_push), _Cycle([episode]))["wall_s"] == \
        pytest.approx(simulate(SimConfig(method="sync", group_size=8, **no_push), _Cycle([episode]))["wall_s"])


def test_one_slow_episode_per_group_sets_the_sync_step_time():
    fast, slow = Episode([10], [], 20), Episode([200], [], 210)
    cfg = SimConfig(method="sync", batch_size=8, group_size=8, trajectories=40, train_tokens_per_s_per_gpu=1e9,
                    **_flat_engine())
    result = simulate(cfg, _Cycle([slow] + [fast] * 7))
    assert result["steps"] == 5
    assert result["wall_s"] == pytest.approx(5 * 2.0, rel=1e-6)        # 200 tokens at 100 tok/s per step
    # the engine is busy the whole time (the slow one decodes), but 7 of 8 sequences wait for it
    assert result["rollout_busy_share"] == pytest.approx(1.0, rel=1e-6)


def test_async_overlaps_the_tail_and_respects_the_staleness_bound():
    work = Workload(turns_p_more=0.2, max_turns=31, action_tokens_per_turn=12, tool_median_s=0.1, tool_sigma=1.2)
    common = dict(batch_size=16, trajectories=320, train_tokens_per_s_per_gpu=3000, push_s=0.05,
                  step_overhead_s=0.004, step_per_row_s=0.002, max_batch=32)
    sync = simulate(SimConfig(method="sync", group_size=8, **common), work)
    sao = simulate(SimConfig(method="async", group_size=1, max_staleness=4, **common), work)
    assert sao["trajectories_per_s"] > sync["trajectories_per_s"]
    assert sao["rollout_idle_share"] < sync["rollout_idle_share"]
    assert 0 < sao["staleness_mean"] <= 4 and sync["staleness_mean"] == 0
    assert sync["trained"] == sao["trained"] == 320


def test_colocated_sync_uses_every_gpu_for_both_phases():
    work = _Cycle([Episode([100], [], 110)])
    common = dict(method="sync", batch_size=8, group_size=8, trajectories=16, train_tokens_per_s_per_gpu=880,
                  **_flat_engine())
    split = simulate(SimConfig(rollout_gpus=1, train_gpus=1, **common), work)
    colocated = simulate(SimConfig(rollout_gpus=1, train_gpus=1, colocated=True, **common), work)
    # decoding is per-sequence bound (same time), training runs on 2 GPUs instead of 1 (half the time)
    assert split["wall_s"] == pytest.approx(2 * (1.0 + 1.0))
    assert colocated["wall_s"] == pytest.approx(2 * (1.0 + 0.5))


def test_recompute_engine_pays_for_the_padded_context():
    # no KV cache: every step re-encodes the left-padded contexts of its rows
    cfg = dict(method="async", batch_size=1, in_flight=1, trajectories=1, train_tokens_per_s_per_gpu=1e12,
               engine_mode="recompute", step_overhead_s=0.01, step_per_row_s=0.0, step_per_position_s=0.001,
               max_batch=8)
    one = simulate(SimConfig(**cfg), _Cycle([Episode([3], [], 13, prompt_tokens=10)]))
    assert one["wall_s"] == pytest.approx(3 * 0.01 + 0.001 * (10 + 11 + 12))
    # two sequences in one step: both rows pay the longer context
    two = simulate(SimConfig(**{**cfg, "batch_size": 2, "in_flight": 2, "trajectories": 2}),
                   _Cycle([Episode([1], [], 11, prompt_tokens=10), Episode([1], [], 31, prompt_tokens=30)]))
    assert two["wall_s"] == pytest.approx(0.01 + 2 * 0.001 * 30)
    # a second turn continues from the context plus the observation tokens
    turns = simulate(SimConfig(**cfg), _Cycle([Episode([1, 1], [0.5], 20, prompt_tokens=10)]))   # 8 obs tokens
    assert turns["wall_s"] == pytest.approx(0.01 + 0.001 * 10 + 0.5 + 0.01 + 0.001 * 19)


def test_engine_params_round_trip():
    a, b = engine_params(decode_tokens_per_s=4000, seq_tokens_per_s=40, max_batch=256)
    assert 1 / (a + b) == pytest.approx(40)
    assert 256 / (a + 256 * b) == pytest.approx(4000)


def test_anchor_reconstructions_run():
    rows = simulator.run_anchors(seeds=1, scale=32)
    assert {r["anchor"] for r in rows} == set(simulator.ANCHORS)
    assert all(r["predicted"] > 0 for r in rows)


# ----------------------------------------------------------------------------------------- script smoke runs
@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The scripts set one torch thread for their process; give the rest of the session its setting back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_learner_step_smoke(tmp_path, sao_cache, monkeypatch):
    monkeypatch.setenv("SAO_CACHE_DIR", str(sao_cache))
    import learner_step

    assert learner_step.main(["--quick", "--batch-size", "3", "--reps", "1", "--p-more", "1.0",
                              "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "learner_step.json").read_text())
    assert result["overhead_ratio"] > 0 and result["settings"]["batch_rows"] == 3
    assert (tmp_path / "learner_step.png").stat().st_size > 0


def test_weight_push_smoke(tmp_path, sao_cache, monkeypatch):
    monkeypatch.setenv("SAO_CACHE_DIR", str(sao_cache))
    import weight_push

    assert weight_push.main(["--quick", "--reps", "1", "--output", str(tmp_path)]) == 0
    case = json.loads((tmp_path / "weight_push.json").read_text())["cases"][0]
    assert case["engine"] == "hf" and case["final_version"] == 2 and case["bytes"] > 0


def test_async_vs_sync_smoke_and_simulator_validation(tmp_path, sao_cache, monkeypatch):
    monkeypatch.setenv("SAO_CACHE_DIR", str(sao_cache))
    import async_vs_sync

    assert async_vs_sync.main(["--model", "embedded:tiny", "--tails", "none", "--batch-size", "4",
                               "--group-size", "2", "--steps", "2", "--max-new-tokens-per-turn", "6",
                               "--max-total-tokens", "96", "--service", "thread", "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "async_vs_sync.json").read_text())
    arms = result["tails"][0]["arms"]
    assert set(arms) == {"sync_grpo", "sao_eqC", "async_grpo", "sao", "gen_only", "train_only_sao",
                         "train_only_grpo"}
    assert all(r["trajectories"] == 8 for r in arms.values())
    derived = result["tails"][0]["derived"]["steady"]
    assert derived["sync_grpo"]["vs_sync_grpo"] == pytest.approx(1.0) and "limit" in derived["sao"]
    validation = simulator.predict_measured(result)
    assert {r["arm"] for r in validation["rows"]} == {"sync_grpo", "sao_eqC", "async_grpo", "sao"}
    assert all(r["predicted"] > 0 for r in validation["rows"])
