"""A discrete-event simulator of RL post-training on a cluster: synchronous GRPO (groups of G, a barrier per
batch) against asynchronous training (SAO: one rollout per prompt; async GRPO: groups) with a staleness bound.

The benchmarks' command line of `sao_core/sim/` (the model is described in `sao_core/sim/model.py`; the same
three commands are `sao simulate run | validate | anchors`). `run` simulates one cluster under sync GRPO and
SAO side by side; `validate` feeds the simulator the inputs measured by bench/async_vs_sync.py (engine step
times, training speed, push seconds, tail settings) and compares the predicted with the measured
trajectories/s; `anchors` reconstructs published async-vs-sync speed-ups (AReaL, verl fully-async, ROLL
Flash) from their stated settings and our assumptions (printed). Reproduce:

    .venv/bin/python bench/simulator.py anchors --output local_outputs/bench/simulator
    .venv/bin/python bench/simulator.py validate local_outputs/bench/async_vs_sync/async_vs_sync.json
    .venv/bin/python bench/simulator.py run --group-size 8 --rollout-gpus 48 --train-gpus 16 --colocated-sync
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _setup  # noqa: E402,F401  (thread settings; puts the repository root on sys.path)

from sao_core.config import field_types  # noqa: E402
from sao_core.sim import ProjectConfig, SimError, anchors, project, validate_results  # noqa: E402
from sao_core.sim.report import format_anchors, format_projection, format_validation  # noqa: E402

_HELP = {"decode_tokens_per_s": "per rollout GPU at max batch", "seq_tokens_per_s": "one sequence alone",
         "episodes": "recorded trajectories: a jsonl (e.g. gen_only/trajectories.jsonl of bench/async_vs_sync.py) "
                     "or a learner journal directory; draw episodes from them",
         "colocated_sync": "sync baseline on all GPUs in turn",
         "sao_in_flight": "async in-flight cap [default (S + 1) B]"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="simulate one setting (sync and async side by side)")
    types = field_types(ProjectConfig)
    for f in dataclasses.fields(ProjectConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name in ("output", "episodes"):          # no default: write nothing / parametric episodes
            p.add_argument(flag, default="", help=_HELP.get(f.name))
        elif types[f.name] is bool:
            p.add_argument(flag, action="store_true", help=_HELP.get(f.name))
        else:
            p.add_argument(flag, type=types[f.name], default=f.default, help=_HELP.get(f.name))
    v = sub.add_parser("validate", help="predicted vs measured for a bench/async_vs_sync.py result")
    v.add_argument("results", help="async_vs_sync.json")
    v.add_argument("--output")
    a = sub.add_parser("anchors", help="published async-vs-sync speed-ups, reconstructed")
    a.add_argument("--output", default="local_outputs/bench/simulator")
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            config = ProjectConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ProjectConfig)})
            print(format_projection(project(config)))
        elif args.command == "validate":
            print(format_validation(validate_results(args.results, args.output)))
        else:
            print(format_anchors(anchors(args.output)["rows"]))
    except SimError as err:
        print(f"simulator.py {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
