"""The documentation site (docs/, mkdocs.yml) builds: the reference generator (docs/gen_reference.py) renders every
`sao` command, every setting of the registry and one page per component with its inputs, `mkdocs build --strict`
(a broken link or anchor fails it) succeeds, and the project README stays a short front page."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _command_paths(parser, path=()):
    """Every command path of the `sao` parser (('train',), ('kfp', 'run'), ...), read from argparse itself."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name)
                yield from _command_paths(sub, (*path, name))


def _registry() -> dict[str, set[str]]:
    """The settings registry: config name -> its setting names (the configs tests/kubeflow/test_settings_parity.py covers)."""
    from sao_core.cluster.launcher import LaunchConfig
    from sao_core.config import settings_of
    from sao_core.learner.config import RLConfig
    from sao_core.training.config import METHOD_CONFIGS

    return {cls.__name__: set(settings_of(cls)) for cls in (RLConfig, *METHOD_CONFIGS.values(), LaunchConfig)}


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    generator = _generator()
    written = generator.generate(out)
    names = [component.name for _, component in generator.component_objects()]
    expected = ["cli.md", "settings.md", "components/index.md", *(f"components/{name}.md" for name in names)]
    assert sorted(p.relative_to(out).as_posix() for p in written) == sorted(expected)
    return out


def test_cli_reference_has_every_command(generated):
    from sao_core.cli import build_parser

    text = (generated / "cli.md").read_text()
    paths = list(_command_paths(build_parser([])))
    assert len(paths) > 20
    missing = [" ".join(p) for p in paths if f"`sao {' '.join(p)}`" not in text]
    assert not missing, f"commands missing from cli.md: {missing}"
    assert "usage: sao" in text


def test_settings_reference_has_every_setting(generated):
    text = (generated / "settings.md").read_text()
    registry = _registry()
    missing = {config: sorted(name for name in names if f"| `{name}` |" not in text)
               for config, names in registry.items()}
    assert not any(missing.values()), f"settings missing from settings.md: {missing}"
    for config in ("RLConfig", "SFTConfig", "DPOConfig", "GKDConfig", "LaunchConfig"):
        assert f"### {config}" in text


def _component_inputs(component) -> list[str]:
    """The parameter names of a component's inputs, read from its component spec."""
    return list(component.component_spec.inputs or {})


def test_components_reference_has_a_page_per_component_with_its_inputs(generated):
    components = [component for _, component in _generator().component_objects()]
    names = [component.name for component in components]
    assert {"sao-train", "evaluate", "prepare-data"} <= set(names)
    index = (generated / "components" / "index.md").read_text()
    for component in components:
        assert f"[`{component.name}`]({component.name}.md)" in index
        page = (generated / "components" / f"{component.name}.md").read_text()
        assert page.startswith(f"# `{component.name}`\n")
        assert "| parameter | type | default | description |" in page
        inputs = _component_inputs(component)
        assert inputs, component.name
        missing = [name for name in inputs if f"`{name}`" not in page]
        assert not missing, f"inputs missing from the page of {component.name}: {missing}"


def test_mkdocs_nav_lists_every_component_page():
    """mkdocs.yml's nav names exactly the generated component pages (a page left out, or one that no longer
    exists, would also fail the strict build; this names which)."""
    import yaml

    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = []

    def collect(entries):
        for entry in entries:
            values = entry.values() if isinstance(entry, dict) else [entry]
            for value in values:
                collect(value) if isinstance(value, list) else pages.append(value)

    collect(config["nav"])
    listed = sorted(p for p in pages if p.startswith("reference/components/"))
    names = [component.name for _, component in _generator().component_objects()]
    assert listed == sorted(["reference/components/index.md", *(f"reference/components/{n}.md" for n in names)])


def test_mkdocs_build_is_strict_and_passes(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs / mkdocs-material not installed (pip install -e '.[docs]', part of the dev extra)")
    # Build a copy of the site so the test writes nothing into the working tree.
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    _generator().generate(tmp_path / "docs" / "reference")
    config = (tmp_path / "mkdocs.yml").read_text()
    assert "strict: true" in config
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    for page in ("concepts", "kubeflow", "methods", "evaluation", "operations", "security",
                 "benchmarks", "known-limits", "contributing", "deployment-and-images", "reference/cli",
                 "reference/settings", "reference/components", "reference/components/sao-train"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def test_readme_is_a_short_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for command in ("make demo", "make test", "make docs"):
        assert command in text
    # every page the README links into exists
    for link in set(re.findall(r"\]\((docs/[^)#]+)", text)):
        assert (ROOT / link).is_file(), link
