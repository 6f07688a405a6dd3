"""Compile entry point: ``python -m pipelines.compile [--output-dir DIR] [--golden]``.

Without flags it writes ``build/pipelines/NAME.yaml`` for every pipeline with the default cluster
settings (the same as ``sao kfp compile``). ``--golden`` regenerates the golden files the tests compare
against (``pipelines/golden/NAME.yaml``, compiled with :data:`GOLDEN_SETTINGS` so they do not depend
on the environment); run it after an intended change to a pipeline or component and review the diff.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sao_core.kfp.k8s import ClusterSettings

GOLDEN_DIR = Path(__file__).parent / "golden"
#: Settings of the golden files: a Kueue queue and pinned image names, independent of SAO_IMAGE_*.
GOLDEN_SETTINGS = ClusterSettings(
    queue_name="team-a-gpu",
    images={"cpu": "registry.example.com/sao-kfp-cpu:golden", "train": "registry.example.com/sao-kfp-cuda:golden",
            "rollout": "registry.example.com/sao-kfp-vllm:golden"},
)


def main(argv: list[str] | None = None) -> int:
    """Compile every pipeline (or the golden files); print the written paths."""
    import pipelines
    from sao_core.kfp.commands import compile_pipelines

    parser = argparse.ArgumentParser(prog="python -m pipelines.compile", description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="build/pipelines")
    parser.add_argument("--golden", action="store_true", help="regenerate pipelines/golden/*.yaml")
    args = parser.parse_args(argv)
    if args.golden:
        paths = compile_pipelines(list(pipelines.PIPELINES), GOLDEN_DIR, GOLDEN_SETTINGS)
    else:
        paths = compile_pipelines(list(pipelines.PIPELINES), args.output_dir)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
