"""Several `sao` command lines, one after the other, in one process: under torchrun each rank runs them in order
in the same process group, so one launch of two processes serves several runs (tests/training/test_trainer.py's
torchrun test: a full-weight and a LoRA run). The command lines are separated by a `---` argument; each prints
what `sao` prints (rank 0's JSON summary). Exits with the first non-zero exit code.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/scripts/cli_runs_worker.py ARGS --- ARGS
"""

from __future__ import annotations

import sys

from sao_core.cli import main as sao_main

SEPARATOR = "---"


def command_lines(argv: list[str]) -> list[list[str]]:
    """`argv` split at each SEPARATOR into the argument lists of single `sao` commands."""
    lines: list[list[str]] = [[]]
    for arg in argv:
        if arg == SEPARATOR:
            lines.append([])
        else:
            lines[-1].append(arg)
    return lines


def main(argv: list[str]) -> int:
    for line in command_lines(argv):
        code = sao_main(line)
        sys.stdout.flush()
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
