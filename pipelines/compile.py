"""Compile entry point: ``python -m pipelines.compile [--output-dir DIR] [--golden] [--docs]``.

Without flags it writes ``build/pipelines/NAME.yaml`` for every pipeline with the default cluster
settings (the same as ``sao kfp compile``). ``--golden`` regenerates the golden files the tests compare
against (``pipelines/golden/NAME.yaml``, compiled with :data:`GOLDEN_SETTINGS` so they do not depend
on the environment); run it after an intended change to a pipeline or component and review the diff.
``--docs`` rewrites the parameter tables of ``pipelines/README.md`` from the compiled pipelines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sao_core.kfp.k8s import ClusterSettings

GOLDEN_DIR = Path(__file__).parent / "golden"
README = Path(__file__).parent / "README.md"
#: Settings of the golden files: a Kueue queue and pinned image names, independent of SAO_IMAGE_*.
GOLDEN_SETTINGS = ClusterSettings(
    queue_name="team-a-gpu",
    images={"cpu": "registry.example.com/sao-kfp-cpu:golden", "train": "registry.example.com/sao-kfp-cuda:golden",
            "rollout": "registry.example.com/sao-kfp-vllm:golden"},
)


def main(argv: list[str] | None = None) -> int:
    """Compile every pipeline (or the golden files); print the written paths."""
    import pipelines
    from pipelines.commands import compile_pipelines

    parser = argparse.ArgumentParser(prog="python -m pipelines.compile", description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="build/pipelines")
    parser.add_argument("--golden", action="store_true", help="regenerate pipelines/golden/*.yaml")
    parser.add_argument("--docs", action="store_true", help="refresh the parameter tables in pipelines/README.md")
    args = parser.parse_args(argv)
    if args.golden:
        paths = compile_pipelines(list(pipelines.PIPELINES), GOLDEN_DIR, GOLDEN_SETTINGS)
    else:
        paths = compile_pipelines(list(pipelines.PIPELINES), args.output_dir)
    for path in paths:
        print(path)
    if args.docs:
        README.write_text(readme_with_tables(README.read_text(), {p.stem: p for p in paths}))
        print(README)
    return 0


def readme_with_tables(text: str, packages: dict[str, Path]) -> str:
    """`text` with each ``<!-- parameters:NAME -->`` block replaced by NAME's parameter table."""
    from sao_core.kfp.spec import parameters_markdown

    for name, path in packages.items():
        start, end = f"<!-- parameters:{name} -->", "<!-- /parameters -->"
        head, sep, rest = text.partition(start)
        if not sep:
            raise SystemExit(f"{README} has no {start} block")
        _, sep2, tail = rest.partition(end)
        if not sep2:
            raise SystemExit(f"{README}: {start} is not closed by {end}")
        text = f"{head}{start}\n### {name}\n\n{parameters_markdown(path)}{end}{tail}"
    return text


if __name__ == "__main__":
    sys.exit(main())
