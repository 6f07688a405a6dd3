"""A discrete-event simulator of RL post-training on a cluster (`sao simulate`): sync GRPO against SAO and
async GRPO, with GPU busy / idle shares per role, trajectories per hour, GPU-hours per 1,000 trajectories and
expected staleness; validated against measured runs and published anchors.

- `model`: the config dataclasses (`SimConfig`, `Workload`, `Episode`) and the simulation (`simulate`)
- `traces`: episodes from recorded trajectories
- `validate`: predicted vs measured (`predict_measured`), published anchors (`ANCHORS`, `run_anchors`)
- `report`: text tables and PNG charts
- `commands`: what `sao simulate run | validate | anchors` call (`project`, `validate_results`, `anchors`)
"""

from sao_core.sim.commands import ProjectConfig, anchors, project, validate_results
from sao_core.sim.model import Episode, SimConfig, SimError, Workload, engine_params, simulate
from sao_core.sim.traces import load_episodes
from sao_core.sim.validate import ANCHORS, predict_measured, run_anchors

__all__ = ["ANCHORS", "Episode", "ProjectConfig", "SimConfig", "SimError", "Workload", "anchors", "engine_params",
           "load_episodes", "predict_measured", "project", "run_anchors", "simulate", "validate_results"]
