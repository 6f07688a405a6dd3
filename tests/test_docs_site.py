"""The documentation site (docs/, mkdocs.yml) builds: the reference generator (docs/gen_reference.py) renders every
`sao` command and every setting of the registry, `mkdocs build --strict` (a broken link or anchor fails it)
succeeds, and the project README stays a short front page."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
    """The settings registry: config name -> its setting names (the configs tests/test_settings_parity.py covers)."""
    from sao_core.cluster.launcher import LaunchConfig
    from sao_core.config import settings_of
    from sao_core.learner.config import RLConfig
    from sao_core.training.config import METHOD_CONFIGS

    return {cls.__name__: set(settings_of(cls)) for cls in (RLConfig, *METHOD_CONFIGS.values(), LaunchConfig)}


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    written = _generator().generate(out)
    assert sorted(p.name for p in written) == ["cli.md", "components.md", "settings.md"]
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


def test_components_reference_has_every_component(generated):
    text = (generated / "components.md").read_text()
    names = [component.name for _, component in _generator().component_objects()]
    assert {"sao-train", "evaluate", "prepare-data"} <= set(names)
    for name in names:
        assert f"## `{name}`" in text
    assert "| parameter | type | default | description |" in text


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
                 "benchmarks", "known-limits", "contributing", "reference/cli", "reference/settings"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def test_readme_is_a_short_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for command in ("make demo", "make test", "make docs"):
        assert command in text
    # every page the README links into exists
    for link in set(re.findall(r"\]\((docs/[^)#]+)", text)):
        assert (ROOT / link).is_file(), link
