"""Compile entry point: ``python -m pipelines.compile [--output-dir DIR] [--golden] [--docs]``.

Without flags it writes ``build/pipelines/NAME.yaml`` for every pipeline with the default cluster
settings (the same as ``sao kfp compile``). ``--golden`` regenerates the golden files the tests compare
against (``pipelines/golden/NAME.yaml``, compiled with :data:`GOLDEN_SETTINGS` so they do not depend
on the environment); run it after an intended change to a pipeline or component and review the diff.
``--docs`` rewrites the parameter tables of ``pipelines/README.md`` from the compiled pipelines and the
settings tables of ``components/README.md`` from the settings registry (``sao_core.config.settings_of``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sao_core.kfp.k8s import ClusterSettings

GOLDEN_DIR = Path(__file__).parent / "golden"
README = Path(__file__).parent / "README.md"
COMPONENTS_README = Path(__file__).parents[1] / "components" / "README.md"
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
        COMPONENTS_README.write_text(readme_with_settings(COMPONENTS_README.read_text()))
        print(README)
        print(COMPONENTS_README)
    return 0


def readme_with_tables(text: str, packages: dict[str, Path]) -> str:
    """`text` with each ``<!-- parameters:NAME -->`` block replaced by NAME's parameter table."""
    from sao_core.kfp.spec import parameters_markdown

    for name, path in packages.items():
        text = _replace_block(text, f"<!-- parameters:{name} -->", "<!-- /parameters -->",
                              f"### {name}\n\n{parameters_markdown(path)}", README)
    return text


def _replace_block(text: str, start: str, end: str, body: str, where: Path) -> str:
    """`text` with what lies between the markers `start` and `end` replaced by `body` (SystemExit naming `where`
    when a marker is missing)."""
    head, sep, rest = text.partition(start)
    if not sep:
        raise SystemExit(f"{where} has no {start} block")
    _, sep2, tail = rest.partition(end)
    if not sep2:
        raise SystemExit(f"{where}: {start} is not closed by {end}")
    return f"{head}{start}\n{body}{end}{tail}"


def settings_configs() -> dict[str, type]:
    """The configs whose settings the components' README tabulates, by the name of their table."""
    from sao_core.cluster.launcher import LaunchConfig
    from sao_core.learner.config import RLConfig
    from sao_core.training.config import DPOConfig, GKDConfig, SFTConfig

    return {"rl": RLConfig, "sft": SFTConfig, "dpo": DPOConfig, "gkd": GKDConfig, "trainjob": LaunchConfig}


def settings_markdown(cls: type, skip: tuple[type, ...] = ()) -> str:
    """Markdown tables of the settings of `cls` (those not defined by a class in `skip`), one per section (headed
    by its title and its YAML key): name, type, default, unit, methods, help."""
    from sao_core.config import settings_of

    skipped = {name for base in skip for name in settings_of(base)}
    by_section: dict[str, list] = {}
    for s in settings_of(cls).values():
        if s.name not in skipped:
            by_section.setdefault(s.section, []).append(s)
    tables = []
    for section, settings in by_section.items():
        rows = [f"#### {settings[0].title} (section `{section}`)", "",
                "| setting | type | default | unit | methods | description |", "|---|---|---|---|---|---|"]
        for s in settings:
            kind = " \\| ".join(map(str, s.choices)) if s.choices else s.type_name()
            default = "(required)" if s.required else repr(s.default) if isinstance(s.default, str) else str(s.default)
            help_text = s.help.replace("|", "\\|")
            rows.append(f"| `{s.name}` | {kind} | `{default}` | {s.unit} | {', '.join(s.methods) or 'all'} | "
                        f"{help_text} |")
        tables.append("\n".join(rows) + "\n")
    return "\n".join(tables)


def readme_with_settings(text: str) -> str:
    """`text` with each ``<!-- settings:NAME -->`` block replaced by the settings table of that config (the
    supervised methods' tables list only what they add to SFTConfig, the TrainJob's only what RLConfig lacks)."""
    from sao_core.training.config import CoreConfig, SFTConfig

    configs = settings_configs()
    skips = {"rl": (), "sft": (), "dpo": (SFTConfig,), "gkd": (SFTConfig,), "trainjob": (configs["rl"], CoreConfig)}
    for name, cls in configs.items():
        text = _replace_block(text, f"<!-- settings:{name} -->", "<!-- /settings -->",
                              f"### {cls.__name__}\n\n{settings_markdown(cls, skips[name])}", COMPONENTS_README)
    return text


if __name__ == "__main__":
    sys.exit(main())
