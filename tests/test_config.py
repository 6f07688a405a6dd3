"""Typed configs from YAML and command-line overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from sao_core.config import ConfigError, load_config


@dataclass
class Example:
    name: str
    steps: int = 10
    lr: float = 1e-3
    whiten: bool = False
    limit: int | None = None
    envs: tuple[str, ...] = ("math",)
    options: dict[str, dict] = dataclasses.field(default_factory=dict)

    def validate(self):
        if self.steps < 1:
            raise ValueError("Example.steps must be >= 1")


def test_defaults_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: run\nsteps: 20\nlr: 0.5\nenvs: [math, swe]\n")
    config = load_config(Example, path, {"steps": "30", "whiten": "true", "limit": "none"})
    assert config == Example(name="run", steps=30, lr=0.5, whiten=True, limit=None, envs=("math", "swe"))
    assert load_config(Example, None, {"name": "x", "envs": "a,b"}).envs == ("a", "b")
    parsed = load_config(Example, None, {"name": "x", "options": '{"tool_arith": {"latency_median_s": 0.1}}'})
    assert parsed.options == {"tool_arith": {"latency_median_s": 0.1}}


@pytest.mark.parametrize("overrides, message", [
    ({"name": "x", "stepz": 3}, "unknown field.*stepz"),
    ({}, "missing required field.*name"),
    ({"name": "x", "steps": "many"}, "field 'steps': expected int"),
    ({"name": "x", "steps": 2.5}, "expected an integer"),
    ({"name": "x", "whiten": "maybe"}, "expected true or false"),
    ({"name": "x", "steps": 0}, "steps must be >= 1"),
    ({"name": {"a": 1}}, "expected a string"),
    ({"name": "x", "options": "{not json"}, "expected a JSON object"),
    ({"name": "x", "options": "[1, 2]"}, "expected a mapping"),
])
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Example, None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Example, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Example, bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(Example, listy)
