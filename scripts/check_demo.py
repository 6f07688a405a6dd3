"""Check a finished `make demo` run: `python scripts/check_demo.py [SUMMARY]` (default
local_outputs/demo/summary.json) exits 1 naming each claim the run did not show (`sao_core.demo.demo_problems`:
verified models, every SAO step, the held-out evaluations, and the held-out sampled reward rising by at least
DEMO_MARGIN), 2 when the summary is missing or unreadable, 0 otherwise. CI runs it after `make demo`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sao_core.demo import DEMO_MARGIN, demo_problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0] if args else "local_outputs/demo/summary.json")
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        print(f"check_demo: cannot read the demo's summary {path}: {err}", file=sys.stderr)
        return 2
    problems = demo_problems(result)
    held = result["held_out"]
    print(f"demo: held-out sampled reward {held['sampled_before']:.3f} -> {held['sampled_after']:.3f} "
          f"(needs a rise of {DEMO_MARGIN}); pipeline {result['pipeline_seconds']} s")
    for problem in problems:
        print(f"check_demo: {path}: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
