"""The learner steps of tests/learner/two_rank_steps.py under torchrun (FSDP2, gloo), then optionally one `sao`
command line, all in one launch: tests/learner/test_learner_distributed.py compares the steps (metrics and
updated weights) with the same steps run in one process, and checks the `sao train-rl` run.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/scripts/learner_step_worker.py \\
        MODEL_DIR OUT.pt [SAO ARGUMENTS...]

OUT.pt (written by rank 0): {"world_size": int, "plain": plain_steps(...), "micro": micro_batched_steps(...)}.
The `sao` command runs after the steps, in the same process group; rank 0 prints its summary.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# the step definitions live beside the tests that compare them
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "learner"))

from two_rank_steps import micro_batched_steps, plain_steps  # noqa: E402

from sao_core.cli import main as sao_main  # noqa: E402
from sao_core.training.distributed import init_distributed  # noqa: E402


def main(argv: list[str]) -> int:
    model_dir, out, sao_args = argv[0], argv[1], argv[2:]
    ctx = init_distributed()
    results = {"world_size": ctx.world_size, "plain": plain_steps(model_dir, ctx),
               "micro": micro_batched_steps(model_dir, ctx)}
    if ctx.is_main:
        torch.save(results, out)
    return sao_main(sao_args) if sao_args else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
