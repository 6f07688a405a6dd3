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


def test_non_finite_floats_are_refused_with_the_field_name(tmp_path):
    from sao_core.learner.config import RLConfig

    for text in ("inf", "-inf", "nan", "Infinity"):
        with pytest.raises(ConfigError, match=f"field 'eps_high': expected a finite number, got '{text}'"):
            load_config(RLConfig, None, {"data": "d", "output": "o", "eps_high": text})
    path = tmp_path / "rl.yaml"
    path.write_text("data: d\noutput: o\npolicy_lr: .nan\n")
    with pytest.raises(ConfigError, match=f"config file {path}: field 'policy_lr': expected a finite number"):
        load_config(RLConfig, path)
    path.write_text("data: d\noutput: o\nsteps: .inf\n")  # an int field given inf: no OverflowError
    with pytest.raises(ConfigError, match="field 'steps': expected int"):
        load_config(RLConfig, path)
    with pytest.raises(ValueError, match="RLConfig.eps_high must be a finite number, got inf"):
        RLConfig(data="d", output="o", eps_high=float("inf")).validate()  # a config built in Python


def test_every_yaml_field_is_checked_even_when_a_flag_overrides_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: run\nsteps: many\n")
    with pytest.raises(ConfigError, match=f"config file {path}: field 'steps': expected int, got 'many'"):
        load_config(Example, path, {"steps": "3"})
    path.write_text("name: run\nlr: [1]\n")
    with pytest.raises(ConfigError, match=f"config file {path}: field 'lr'"):
        load_config(Example, path, {"lr": "0.1", "steps": "3"})
    path.write_text("name: run\noptions: {math: 5}\n")  # values of a dict[str, dict] field are checked too
    with pytest.raises(ConfigError, match=r"field 'options'\['math'\]: expected a mapping, got 5"):
        load_config(Example, path, {"steps": "3"})
    path.write_text("name: run\nstepz: 3\n")
    with pytest.raises(ConfigError, match=f"config file {path}: unknown field"):
        load_config(Example, path, {"steps": "3"})
    with pytest.raises(ConfigError, match="command line: field 'steps': expected int"):
        load_config(Example, None, {"name": "x", "steps": "3.5x"})


@pytest.mark.parametrize("content", [b"\xff\xfe\x00\x01binary\x00\x9c", b"name: caf\xe9\n"])
def test_a_binary_or_non_utf8_yaml_file_is_named(tmp_path, content):
    path = tmp_path / "bin.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"config file {path} is not UTF-8 text"):
        load_config(Example, path)
    with pytest.raises(ConfigError, match=f"config file {tmp_path} cannot be read"):
        load_config(Example, tmp_path)  # a directory
