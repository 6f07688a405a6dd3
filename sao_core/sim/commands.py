"""The three things `sao simulate` (and `bench/simulator.py`) do, each one function that simulates, writes
its JSON (and PNG) and returns the result: `project` (sync GRPO and SAO on one cluster, side by side),
`validate_results` (predicted vs measured for a bench/async_vs_sync.py result) and `anchors` (published
async-vs-sync speed-ups, reconstructed). Errors in the inputs raise SimError (a ValueError)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from sao_core.sim.model import SimConfig, SimError, Workload, engine_params, simulate
from sao_core.sim.report import bar_chart_png
from sao_core.sim.traces import load_episodes
from sao_core.sim.validate import predict_measured, run_anchors


@dataclass
class ProjectConfig:
    """One cluster and workload, simulated under sync GRPO (groups of G) and SAO (one rollout per prompt,
    staleness bound S). Times in seconds, speeds in tokens per second."""

    batch_size: int = SimConfig.batch_size  # trajectories per learner step (B)
    group_size: int = SimConfig.group_size  # G of sync GRPO (B must be a multiple)
    max_staleness: int = SimConfig.max_staleness  # SAO's bound S, in policy versions
    rollout_gpus: int = SimConfig.rollout_gpus  # GPUs that only generate (one engine each)
    train_gpus: int = SimConfig.train_gpus  # GPUs that only train
    max_batch: int = SimConfig.max_batch  # sequences decoded per engine step, at most
    trajectories: int = SimConfig.trajectories  # trained trajectories to simulate per method
    seed: int = SimConfig.seed  # random seed of the episode draws
    train_tokens_per_s_per_gpu: float = SimConfig.train_tokens_per_s_per_gpu  # learner speed, tokens/s per GPU
    train_step_overhead_s: float = SimConfig.train_step_overhead_s  # fixed seconds per learner step
    push_s: float = SimConfig.push_s  # seconds to publish and load new weights after each step
    decode_tokens_per_s: float = 4000.0  # aggregate decode speed of one rollout GPU at max_batch rows, tokens/s
    seq_tokens_per_s: float = 35.0  # decode speed of one sequence alone, tokens/s
    turns_p_more: float = Workload.turns_p_more  # turns = 1 + Geometric(p), at most max_turns (0: always max_turns)
    max_turns: int = Workload.max_turns  # turns per episode, at most
    action_tokens_per_turn: float = Workload.action_tokens_per_turn  # tokens decoded per turn (median)
    action_tokens_sigma: float = Workload.action_tokens_sigma  # log-normal sigma of those tokens (0: constant)
    observation_tokens_per_turn: float = Workload.observation_tokens_per_turn  # tokens a tool call appends
    prompt_tokens: float = Workload.prompt_tokens  # tokens before the first turn
    tool_median_s: float = Workload.tool_median_s  # median seconds of one tool call (log-normal)
    tool_sigma: float = Workload.tool_sigma  # log-normal sigma of the tool seconds (0: constant)
    episodes: str = ""  # recorded trajectories (a jsonl or a learner journal directory) to draw episodes from
    colocated_sync: bool = False  # sync GRPO on every GPU in turn (generate, then train)
    sao_in_flight: int = 0  # SAO's in-flight cap (0: (S + 1) B)
    output: str = "local_outputs/simulate"  # directory for simulate.json / simulate.png ('': write nothing)

    def sim_configs(self) -> tuple[SimConfig, SimConfig]:
        """(sync GRPO, SAO) settings of the simulator."""
        step_overhead_s, step_per_row_s = engine_params(self.decode_tokens_per_s, self.seq_tokens_per_s,
                                                        self.max_batch)
        common = {"batch_size": self.batch_size, "max_staleness": self.max_staleness,
                  "rollout_gpus": self.rollout_gpus, "train_gpus": self.train_gpus,
                  "step_overhead_s": step_overhead_s, "step_per_row_s": step_per_row_s, "max_batch": self.max_batch,
                  "train_tokens_per_s_per_gpu": self.train_tokens_per_s_per_gpu,
                  "train_step_overhead_s": self.train_step_overhead_s, "push_s": self.push_s,
                  "trajectories": self.trajectories, "seed": self.seed}
        return (SimConfig(method="sync", group_size=self.group_size, colocated=self.colocated_sync, **common),
                SimConfig(method="async", group_size=1, in_flight=self.sao_in_flight, **common))

    def workload(self) -> Workload:
        """The episode distribution (recorded episodes when `episodes` is set)."""
        return Workload(turns_p_more=self.turns_p_more, max_turns=self.max_turns,
                        action_tokens_per_turn=self.action_tokens_per_turn,
                        action_tokens_sigma=self.action_tokens_sigma,
                        observation_tokens_per_turn=self.observation_tokens_per_turn,
                        prompt_tokens=self.prompt_tokens, tool_median_s=self.tool_median_s,
                        tool_sigma=self.tool_sigma, episodes=load_episodes(self.episodes) if self.episodes else [])

    def validate(self) -> None:
        """SimError naming the first setting the simulator cannot run with."""
        if not 0 <= self.turns_p_more <= 1:
            raise SimError(f"turns_p_more must be in [0, 1], got {self.turns_p_more}")
        if self.max_turns < 1 or min(self.action_tokens_per_turn, self.tool_median_s, self.action_tokens_sigma,
                                     self.tool_sigma, self.prompt_tokens, self.observation_tokens_per_turn) < 0:
            raise SimError("max_turns must be >= 1 and token counts, tool seconds and sigmas >= 0")
        for cfg in self.sim_configs():
            cfg.validate()


def project(config: ProjectConfig) -> dict:
    """Simulate sync GRPO and SAO on the cluster of `config`; write `simulate.json` (settings and every metric
    of both) and `simulate.png` (busy / idle shares per role) under `config.output` unless it is empty.
    Returns {"settings", "sync", "sao", "files"}."""
    config.validate()
    sync_cfg, sao_cfg = config.sim_configs()
    workload = config.workload()
    sync = simulate(sync_cfg, workload)
    sao = simulate(sao_cfg, workload)
    result = {"settings": {**asdict(config), "sao_in_flight_cap": sao_cfg.cap}, "sync": sync, "sao": sao,
              "files": {}}
    if config.output:
        out = Path(config.output)
        out.mkdir(parents=True, exist_ok=True)
        result["files"]["json"] = str(out / "simulate.json")
        shares = ("rollout_busy_share", "rollout_idle_share", "train_busy_share", "train_idle_share",
                  "learner_wait_share")
        if bar_chart_png(out / "simulate.png", f"simulated shares of wall time: sync GRPO (G={config.group_size}) "
                         f"vs SAO (S={config.max_staleness}); SAO / sync trajectories/s = "
                         f"{sao['trajectories_per_s'] / sync['trajectories_per_s']:.2f}x", list(shares),
                         {"sync GRPO": [sync[k] for k in shares], "SAO": [sao[k] for k in shares]}):
            result["files"]["png"] = str(out / "simulate.png")
        (out / "simulate.json").write_text(json.dumps({k: v for k, v in result.items() if k != "files"},
                                                      indent=2) + "\n")
    return result


def validate_results(results: str | Path, output: str | Path | None = None) -> dict:
    """Predicted vs measured trajectories/s for every learner arm of a bench/async_vs_sync.py result
    (`predict_measured`); writes simulator_validation.json and .png under `output` (default: next to
    `results`). Returns the validation with its "files"."""
    path = Path(results)
    try:
        measured = json.loads(path.read_text())
    except FileNotFoundError:
        raise SimError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SimError(f"{path} is not a readable JSON file: {err}") from None
    try:
        validation = predict_measured(measured)
    except (KeyError, TypeError, IndexError) as err:
        raise SimError(f"{path} is not a complete bench/async_vs_sync.py result "
                       f"({type(err).__name__}: {err})") from None
    target = Path(output) if output else path.parent
    target.mkdir(parents=True, exist_ok=True)
    (target / "simulator_validation.json").write_text(json.dumps(validation, indent=2) + "\n")
    files = {"json": str(target / "simulator_validation.json")}
    rows = validation["rows"]
    if rows and bar_chart_png(target / "simulator_validation.png", "simulator: predicted vs measured "
                              "trajectories/s (bench/async_vs_sync.py)", [f"{r['tail']}: {r['arm']}" for r in rows],
                              {"measured": [r["measured"] for r in rows], "predicted": [r["predicted"] for r in rows]}):
        files["png"] = str(target / "simulator_validation.png")
    return {**validation, "files": files}


def anchors(output: str | Path = "local_outputs/bench/simulator", seeds: int = 3, scale: int = 1) -> dict:
    """Reconstruct the published anchors (`run_anchors`: `seeds` runs per method; `scale` > 1 divides batch
    sizes and GPU counts for a quick look) and write anchors.json (the rows) and anchors.png under `output`.
    Returns {"rows", "files"}."""
    if seeds < 1 or scale < 1:
        raise SimError("seeds and scale must be >= 1")
    rows = run_anchors(seeds=seeds, scale=scale)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "anchors.json").write_text(json.dumps(rows, indent=2) + "\n")
    files = {"json": str(out / "anchors.json")}
    if bar_chart_png(out / "anchors.png", "async / sync speed-up: published vs simulated (reconstructed settings)",
                     [r["anchor"] for r in rows], {"published": [r["published"] for r in rows],
                                                   "simulated": [r["predicted"] for r in rows]}, unit="x"):
        files["png"] = str(out / "anchors.png")
    return {"rows": rows, "files": files}
