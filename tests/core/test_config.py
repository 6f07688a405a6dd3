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


# ----------------------------------------------------------------------------- settings in sections (issue 41)
def test_a_setting_needs_a_known_section_where_it_is_defined():
    from sao_core.config import SECTIONS, setting

    with pytest.raises(ValueError, match="needs its section, one of model_and_data, optimisation"):
        setting(3, "steps of something")                       # raised when the config's module is imported
    with pytest.raises(ValueError, match="got 'staleness'"):
        setting(3, "steps of something", section="staleness")
    assert setting(3, "steps of something", section="admission").metadata["section"] == "admission"
    assert all(key.isidentifier() and title for key, title in SECTIONS.items())


def test_every_registered_setting_has_a_section_of_the_vocabulary():
    from sao_core.cluster.launcher import LaunchConfig
    from sao_core.config import SECTIONS, settings_of
    from sao_core.eval.config import EvalConfig
    from sao_core.learner.config import RLConfig
    from sao_core.training.config import METHOD_CONFIGS

    for cls in (RLConfig, EvalConfig, LaunchConfig, *METHOD_CONFIGS.values()):
        for s in settings_of(cls).values():
            assert s.section in SECTIONS and s.title == SECTIONS[s.section], (cls.__name__, s.name)
    rl = settings_of(RLConfig)
    assert (rl["max_staleness"].section, rl["critic_lr"].section, rl["lora_rank"].section) == (
        "admission", "critic", "lora")


def test_a_mapping_setting_named_like_a_section_is_refused():
    from sao_core.config import setting, settings_of

    @dataclass
    class Clash:
        lora: dict = setting(factory=dict, help="adapter options", section="lora")

    with pytest.raises(TypeError, match="Clash.lora is a mapping named like the section 'lora'"):
        settings_of(Clash)


def _rl_file(tmp_path, text: str):
    path = tmp_path / "rl.yaml"
    path.write_text("data: d\noutput: o\n" + text)
    return path


def test_a_yaml_config_may_group_settings_in_sections(tmp_path):
    from sao_core.learner.config import RLConfig

    flat = load_config(RLConfig, _rl_file(tmp_path, "max_staleness: 2\nadmission: fragments\ncritic_lr: 1.0e-5\n"))
    nested = load_config(RLConfig, _rl_file(tmp_path, "admission:\n  max_staleness: 2\n  admission: fragments\n"
                                                      "critic: {critic_lr: 1.0e-5}\n"))
    assert nested == flat
    assert (nested.max_staleness, nested.admission, nested.critic_lr) == (2, "fragments", 1e-5)
    # `admission` names a section and a setting: a mapping is the section, a value the setting; flags still win
    mixed = load_config(RLConfig, _rl_file(tmp_path, "admission: window\ncritic: {critic_updates: 3}\n"),
                        {"max_staleness": "6"})
    assert (mixed.admission, mixed.critic_updates, mixed.max_staleness) == ("window", 3, 6)
    # the core's settings (CoreConfig) have their sections too
    assert load_config(RLConfig, _rl_file(tmp_path, "optimisation: {steps: 7}\nlora: {lora_rank: 4}\n")).steps == 7


@pytest.mark.parametrize("text, message", [
    ("critic: {max_staleness: 2}\n", "max_staleness is not in section 'critic' of RLConfig: write it in section "
                                     "'admission' \\(staleness and admission\\) or at the top level"),
    ("dpo: {beta: 0.2}\n", "RLConfig has no section 'dpo'; its sections: model_and_data, optimisation"),
    ("admission: {max_stalenes: 2}\n", "unknown field 'max_stalenes' in section 'admission' of RLConfig; the "
                                       "section holds: max_staleness, admission, hard_staleness"),
    ("max_staleness: 2\nadmission: {max_staleness: 3}\n", "max_staleness is given twice, as max_staleness and "
                                                          "as admission.max_staleness; set it once"),
    ("admision: {max_staleness: 2}\n", "unknown field\\(s\\) admision for RLConfig; known: .*; or grouped in "
                                       "sections: model_and_data, "),
    ("admission: {max_staleness: many}\n", "field 'max_staleness': expected int, got 'many'"),
])
def test_a_wrong_section_names_the_file_the_field_and_the_right_place(tmp_path, text, message):
    from sao_core.learner.config import RLConfig

    path = _rl_file(tmp_path, text)
    with pytest.raises(ConfigError, match=f"config file {path}: {message}"):
        load_config(RLConfig, path)


def test_component_options_may_be_given_in_sections():
    from sao_core.config import config_defaults, merge_options
    from sao_core.kfp import artifacts
    from sao_core.learner.config import RLConfig

    explicit = {"data": "d", "output": "o", "max_staleness": 4, "admission": "window"}
    config = artifacts.build(RLConfig, explicit, {"admission": {"max_staleness": 6, "hard_staleness": 9}},
                             "sao_train")
    assert (config.max_staleness, config.hard_staleness, config.admission) == (6, 9, "window")
    with pytest.raises(ConfigError, match="sao_train: max_staleness is given both as a parameter \\(5\\) and in "
                                          "options \\(6\\); set it once"):
        artifacts.build(RLConfig, {**explicit, "max_staleness": 5}, {"admission": {"max_staleness": 6}}, "sao_train")
    with pytest.raises(ConfigError, match="sao_train options: critic_lr is not in section 'admission' of RLConfig: "
                                          "write it in section 'critic'"):
        artifacts.build(RLConfig, explicit, {"admission": {"critic_lr": 1.0}}, "sao_train")
    merged = merge_options({"steps": 3}, {"critic": {"critic_lr": 2e-6}}, config_defaults(RLConfig), "launch",
                           config=RLConfig)
    assert merged == {"steps": 3, "critic_lr": 2e-6}


def test_a_trainjobs_rl_options_may_be_given_in_sections():
    from sao_core.cluster.launcher import LaunchConfig
    from sao_core.cluster.names import ClusterConfigError

    def launch(rl_options):
        return LaunchConfig(image="i", rollout_image="r", data="s3://data/rl", output="s3://runs/r1/sao", run_id="r1",
                            rl_options=rl_options)

    config = launch({"steps": 3, "admission": {"max_staleness": 2}, "critic": {"critic_updates": 3}})
    config.validate()
    rl = config.rl_config()
    assert (rl.steps, rl.max_staleness, rl.critic_updates) == (3, 2, 3)
    assert config.rl_values()["max_staleness"] == 2 and "critic" not in config.rl_values()
    with pytest.raises(ClusterConfigError, match="rl_options may not set services"):
        launch({"rollout": {"services": ["http://x"]}}).validate()        # a reserved setting inside its section
    with pytest.raises(ClusterConfigError, match="rl_options: steps is not in section 'critic'"):
        launch({"critic": {"steps": 3}}).validate()
