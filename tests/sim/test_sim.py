"""The cluster simulator (sao_core/sim): cases with known answers, recorded episodes, the validation
helpers, and `sao simulate` on the command line (help, a real run, bad inputs exiting 2 with one line)."""

from __future__ import annotations

import itertools
import json

import pytest

from sao_core.cli import build_parser, main
from sao_core.sim import (
    ANCHORS,
    Episode,
    ProjectConfig,
    SimConfig,
    SimError,
    Workload,
    engine_params,
    load_episodes,
    project,
    run_anchors,
    simulate,
)


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
    rows = run_anchors(seeds=1, scale=32)
    assert {r["anchor"] for r in rows} == set(ANCHORS)
    assert all(r["predicted"] > 0 for r in rows)


def test_bad_settings_raise_sim_error_naming_the_setting():
    with pytest.raises(SimError, match="multiple of group_size"):
        simulate(SimConfig(method="sync", batch_size=12, group_size=8), Workload())
    with pytest.raises(SimError, match="train_tokens_per_s_per_gpu"):
        simulate(SimConfig(train_tokens_per_s_per_gpu=0), Workload())
    with pytest.raises(SimError, match="must be > 0"):
        engine_params(decode_tokens_per_s=0, seq_tokens_per_s=35, max_batch=8)


# ----------------------------------------------------------------------------------------- recorded episodes
def _trajectory(mask: list[int], tool_seconds: float) -> dict:
    return {"token_ids": list(range(len(mask))), "action_mask": mask, "num_turns": 2,
            "timings": {"tool_seconds": tool_seconds}}


def test_load_episodes_splits_turns_at_the_action_mask(tmp_path):
    # prompt (2) | action 2 | observation 3 | action 1
    path = tmp_path / "trajectories.jsonl"
    path.write_text(json.dumps(_trajectory([0, 0, 1, 1, 0, 0, 0, 1], 0.6)) + "\n")
    (episode,) = load_episodes(str(path))
    assert episode.action_tokens == [2, 1] and episode.tool_s == [0.6] and episode.tokens == 8
    assert episode.prompt_tokens == 2 and episode.observation_tokens() == 3
    journal = tmp_path / "journal"
    journal.mkdir()
    (journal / "step-000001.json").write_text(json.dumps({"trajectories": [_trajectory([0, 1, 1], 0.0)] * 2}))
    assert [e.action_tokens for e in load_episodes(str(journal))] == [[2], [2]]


def test_load_episodes_refuses_files_without_trajectories(tmp_path):
    with pytest.raises(SimError, match="do not exist"):
        load_episodes(str(tmp_path / "missing.jsonl"))
    (tmp_path / "other.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(SimError, match="does not hold recorded trajectories"):
        load_episodes(str(tmp_path / "other.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SimError, match="no trajectories"):
        load_episodes(str(tmp_path / "empty"))


def test_project_runs_sync_and_sao_on_the_same_cluster(tmp_path):
    # one-turn episodes of constant length, no tools: with SAO at B in flight there is no tail to overlap
    config = ProjectConfig(batch_size=8, group_size=8, trajectories=32, turns_p_more=1.0, max_turns=1,
                           tool_median_s=0.0, tool_sigma=0.0, sao_in_flight=8, output=str(tmp_path))
    result = project(config)
    assert result["sync"]["trained"] == result["sao"]["trained"] == 32
    assert result["sao"]["wall_s"] == pytest.approx(result["sync"]["wall_s"])
    written = json.loads((tmp_path / "simulate.json").read_text())
    assert written["settings"]["sao_in_flight_cap"] == 8 and written["sync"]["steps"] == 4
    assert (tmp_path / "simulate.png").stat().st_size > 0


# ----------------------------------------------------------------------------------------- sao simulate
@pytest.mark.parametrize("action", ["run", "validate", "anchors"])
def test_simulate_help(action, capsys):
    argv = ["simulate", action, "--help"]
    with pytest.raises(SystemExit) as exit_info:
        build_parser(argv).parse_args(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: sao simulate " + action in out
    if action == "run":
        assert all(flag in out for flag in ("--config", "--group-size", "--max-staleness", "--rollout-gpus",
                                            "--decode-tokens-per-s", "--episodes", "--colocated-sync"))


def test_sao_simulate_run_from_yaml_and_flags(tmp_path, capsys):
    config = tmp_path / "cluster.yaml"
    config.write_text("batch_size: 16\ngroup_size: 8\nrollout_gpus: 2\ntrain_gpus: 1\ntrajectories: 64\n"
                      "push_s: 0.5\n")
    out = tmp_path / "out"
    assert main(["--quiet", "simulate", "run", "--config", str(config), "--max-staleness", "2",
                 "--colocated-sync", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "sync GRPO (G=8, colocated):" in printed and "SAO (S=2, in flight 48):" in printed
    assert "SAO / sync = " in printed and f"json: {out / 'simulate.json'}" in printed
    result = json.loads((out / "simulate.json").read_text())
    assert result["settings"]["rollout_gpus"] == 2 and result["settings"]["max_staleness"] == 2
    assert result["sync"]["config"]["colocated"] and result["sao"]["trained"] >= 64
    for method in ("sync", "sao"):
        assert 0 <= result[method]["rollout_idle_share"] <= 1 and result[method]["gpu_hours_per_1000"] > 0


def test_sao_simulate_anchors_quick(tmp_path, capsys):
    assert main(["--quiet", "simulate", "anchors", "--seeds", "1", "--scale", "32", "--output", str(tmp_path)]) == 0
    assert "AReaL" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "anchors.json").read_text())) == len(ANCHORS)


@pytest.mark.parametrize("argv, message", [
    (["run", "--batch-size", "12", "--group-size", "8"], "batch_size must be a multiple of group_size"),
    (["run", "--trajectories", "lots"], "expected int"),
    (["run", "--episodes", "/nonexistent/trajectories.jsonl", "--output", ""], "do not exist"),
    (["validate", "/nonexistent/async_vs_sync.json"], "does not exist"),
    (["validate", "{not_json}"], "not a bench/async_vs_sync.py result"),
])
def test_sao_simulate_bad_input_exits_2_with_one_line(argv, message, tmp_path, capsys):
    if argv[-1] == "{not_json}":
        bogus = tmp_path / "other.json"
        bogus.write_text(json.dumps({"rows": []}))
        argv = [*argv[:-1], str(bogus)]
    assert main(["--quiet", "simulate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"sao simulate {argv[0]}: error: ") and message in err and "\n" not in err


def test_abandoning_stale_episodes_saves_their_decoding_and_trains_the_same():
    """Async with a tight bound: an episode that can no longer be trained ends at its next turn instead of
    decoding to the end; the learner would drop it either way, so the trained set keeps its size and the
    engine decodes less (here it is the bottleneck, so the run is faster)."""
    work = Workload(turns_p_more=0.2, max_turns=31, action_tokens_per_turn=12, tool_median_s=0.1, tool_sigma=1.2)
    common = dict(method="async", batch_size=16, trajectories=320, train_tokens_per_s_per_gpu=1e6, push_s=0.0,
                  step_overhead_s=0.004, step_per_row_s=0.002, max_batch=32, max_staleness=1)
    full = simulate(SimConfig(abandon_stale=False, **common), work)
    early = simulate(SimConfig(abandon_stale=True, **common), work)
    assert full["trained"] == early["trained"] == 320
    assert full["dropped"] > 0 and early["dropped"] > 0
    # measured: 26,462 -> 19,672 tokens decoded, 59.1 -> 43.9 s
    assert early["decoded_tokens"] < 0.85 * full["decoded_tokens"]
    assert early["wall_s"] < 0.85 * full["wall_s"]
    assert early["staleness_mean"] <= 1 and full["staleness_mean"] <= 1
