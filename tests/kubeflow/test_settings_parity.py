"""One source of truth for every setting (issue 28): each setting is defined once, as a field of a config
dataclass made with ``sao_core.config.setting`` (name, type, default, unit, help, methods). Every copy of a
setting is checked against that definition here, and any drift fails, naming the copy and the setting:

- the KFP components' and pipelines' (and their inner stages') parameters named like a setting: the default
  (value and type), the type, and the description the compiled IR carries (the docstring's Args line) must be the
  setting's; an optional parameter (default None) must say ``(None = default X)`` with the setting's X;
- the pipelines' dropdowns (``LITERALS``) must list exactly the setting's allowed values (its ``Literal``);
- a setting defined by two configs (the TrainJob launcher's and the learner's) must agree in help and values;
- the settings tables of components/README.md are the ones ``python -m pipelines.compile --docs`` renders;
- the CLI's ``--help`` of each setting is built from the definition (so it cannot drift; checked once), and so
  are its --help group and its table in the settings reference (the section named where it is defined).

A difference on purpose is listed in ON_PURPOSE with its reason; the tests below plant each kind of drift
and see the check fail."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any, Literal, Optional

import docstring_parser
import pytest

from sao_core.config import Setting, _base_type, config_defaults, settings_of
from sao_core.learner.config import RLConfig

#: (copy, parameter) -> why that copy's default differs from the setting's
ON_PURPOSE = {
    ("sao_train", "engine"): "a KFP pod rolls out with vLLM on its GPUs; the CLI's default hf runs anywhere",
    ("grpo_train", "engine"): "as sao_train",
    ("sao_rl", "b_engine"): "as sao_train",
    ("sao-single-pod-stage", "engine"): "as sao_train",
    ("sao-trainjob-rl-stage", "engine"): "as sao_train",
    ("grpo_train", "method"): "the GRPO component's own method",
    ("launch_trainjob", "gpus_per_node"): "a TrainJob's learner node is a whole 8-GPU node; the runtime's 1 is for tests",
    ("sao_rl", "d_trainjob_gpus_per_node"): "as launch_trainjob",
    ("sao-trainjob-rl-stage", "gpus_per_node"): "as launch_trainjob",
    ("launch_trainjob", "timeout_s"): "the same 7 days, written as a float literal KFP can compile",
    ("launch_trainjob", "engine"): "as sao_train",
    ("post_training", "b_engine"): "as sao_train",
    ("post_training", "d_trainjob_gpus_per_node"): "as launch_trainjob",
}
#: (copy, parameter) -> why its description is not the setting's help (it serves several methods' settings)
OWN_HELP = {
    ("post_training", name): "one post_training parameter serves every method's setting of that name"
    for name in ("b_steps", "b_batch_size", "b_max_tokens", "b_engine", "a_method")
}
#: pipeline parameters whose name is a setting's but that are something else (name -> reason)
NOT_A_SETTING = {
    ("post_training", "a_method"): "the post_training method (sft ... sao), not RLConfig.method",
    ("post_training", "b_batch_size"): "examples (sft ...) or trajectories (grpo, sao): one parameter for both",
    **{(copy, name): "the final evaluation's (EvalConfig limit / options), not the evaluation during training's"
       for copy, names in (("post_training", ("c_eval_limit", "c_eval_options")),
                           ("sao_rl", ("c_eval_limit", "c_eval_options"))) for name in names},
}
#: what a description may say before the setting's help (the context the parameter applies in)
CONTEXTS = ("placement=trainjob: ", "`d_placement=trainjob`: ")


def registry() -> dict[str, dict[str, Setting]]:
    """Every config's settings (the registry), by config name."""
    from sao_core.cluster.launcher import LaunchConfig
    from sao_core.training.config import METHOD_CONFIGS

    return {cls.__name__: settings_of(cls) for cls in (RLConfig, *METHOD_CONFIGS.values(), LaunchConfig)}


def _copies() -> list[tuple[str, Any, tuple[str, ...], dict]]:
    """(copy name, its Python function, the configs whose settings it carries, its dropdowns)."""
    import pipelines
    from components.cpt import cpt_train
    from components.dpo import dpo_train
    from components.gkd import gkd_train
    from components.grpo import grpo_train
    from components.launch_trainjob import launch_trainjob
    from components.sao import sao_train
    from components.sft import sft_train
    from pipelines._stages import build_trainjob_stage
    from pipelines.sao_rl import build_sao_stages
    from sao_core.kfp import k8s

    sao_rl = pipelines.build("sao_rl", None)
    post = pipelines.build("post_training", None)
    settings = k8s.ClusterSettings()
    single, multi = build_sao_stages(settings)
    rl_and_launch = ("RLConfig", "LaunchConfig")
    return [
        ("sao_train", sao_train.python_func, ("RLConfig",), {}),
        ("grpo_train", grpo_train.python_func, ("RLConfig",), {}),
        ("sft_train", sft_train.python_func, ("SFTConfig",), {}),
        ("cpt_train", cpt_train.python_func, ("CPTConfig",), {}),
        ("dpo_train", dpo_train.python_func, ("DPOConfig",), {}),
        ("gkd_train", gkd_train.python_func, ("GKDConfig",), {}),
        ("launch_trainjob", launch_trainjob.python_func, rl_and_launch, {}),
        ("sao_rl", sao_rl.func.pipeline_func, rl_and_launch, sao_rl.literals),
        ("sao-single-pod-stage", single.pipeline_func, rl_and_launch, {}),
        ("sao-trainjob-rl-stage", multi.pipeline_func, rl_and_launch, {}),
        ("sao-trainjob-stage", build_trainjob_stage(settings, "sao", sao_parameters=True).pipeline_func,
         rl_and_launch, {}),
        ("grpo-trainjob-stage", build_trainjob_stage(settings, "grpo").pipeline_func, rl_and_launch, {}),
        ("post_training", post.func.pipeline_func, ("RLConfig", "SFTConfig", "LaunchConfig"), post.literals),
    ]


#: parameter names of the components and pipelines that differ from the setting's (parameter -> setting)
ALIASES = {"accelerator_type": "accelerator"}
#: a pipeline's group prefix for the KFP UI's alphabetical order (a_ ... d_, TrainJob shape d_trainjob_)
GROUP_PREFIX = re.compile(r"^[a-d]_(trainjob_)?")


def setting_name(copy: str, parameter: str) -> str:
    """The setting a parameter carries: its name past the group prefix (sao_rl) and the aliases."""
    if copy in ("sao_rl", "post_training"):
        parameter = GROUP_PREFIX.sub("", parameter)
    return ALIASES.get(parameter, parameter)


def _kind(annotation: Any) -> Any:
    """int / float / str / bool / dict / list of an annotation (Optional, Literal and generics unwrapped)."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"Optional": Optional, "dict": dict, "list": list})  # noqa: S307 (our own source)
    inner, _ = _base_type(annotation)
    if typing.get_origin(inner) is Literal:
        return type(typing.get_args(inner)[0])
    if typing.get_origin(inner) is typing.Union:       # typing.Optional[X] spelt the KFP way
        inner = next(a for a in typing.get_args(inner) if a is not type(None))
    origin = typing.get_origin(inner) or inner
    return {tuple: list}.get(origin, origin)


def _same(text: str, value: Any) -> bool:
    """Whether a default written in prose (`5e-6`, `no_drop`, `4`) is `value`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return text == str(value)


def _clean(text: str) -> str:
    """Whitespace, a first capital, a closing full stop and code-span backticks (the KFP UI renders descriptions
    as Markdown, so the pipelines write names in code spans) do not count."""
    text = " ".join(text.replace("`", "").split()).rstrip(".")
    return text[:1].upper() + text[1:]


def drifts(copy: str, func, configs: tuple[str, ...], literals: dict, reg: dict[str, dict[str, Setting]]) -> list[str]:
    """Every way the parameters of `func` (copy `copy`) differ from the settings of `configs` they carry."""
    docs = {p.arg_name: p.description or "" for p in docstring_parser.parse(inspect.getdoc(func) or "").params}
    found = []
    for p in inspect.signature(func).parameters.values():
        if "Annotated[kfp.dsl" in str(p.annotation) or "Input[" in str(p.annotation) or "Output[" in str(p.annotation):
            continue   # an artifact (data, model, ...), not a setting's value
        name = setting_name(copy, p.name)
        setting = next((reg[c][name] for c in configs if name in reg[c]), None)
        if setting is None or (copy, p.name) in NOT_A_SETTING:
            continue
        where = f"{copy}.{p.name}"
        if p.annotation is not inspect.Parameter.empty and setting.type is not Any:
            if _kind(p.annotation) is not _kind(setting.type):
                found.append(f"{where}: type {_kind(p.annotation).__name__}, the setting "
                             f"({setting.owner}.{name}) is {_kind(setting.type).__name__}")
        doc = docs.get(p.name)
        if doc is None:
            found.append(f"{where}: no description in the docstring (the compiled IR would carry none)")
            doc = ""
        optional = re.search(r"\s*\(None = default (.+)\)\.?$", doc)
        if p.default is None:
            if not optional:
                found.append(f"{where}: optional, but its description does not say (None = default X)")
            elif not _same(optional.group(1).strip(), setting.default):
                found.append(f"{where}: the description says default {optional.group(1).strip()}, "
                             f"{setting.owner} says {setting.default!r}")
        elif p.default is not inspect.Parameter.empty and (copy, p.name) not in ON_PURPOSE:
            default = p.default
            expected = setting.default
            if default != expected or type(default) is not type(expected):
                found.append(f"{where}: default {default!r}, {setting.owner} says {expected!r}")
        if (copy, p.name) not in OWN_HELP:
            said = " ".join((doc[:optional.start()] if optional else doc).split())
            said = next((said[len(c):] for c in CONTEXTS if said.startswith(c)), said)
            if _clean(said) != _clean(setting.help):
                found.append(f"{where}: description {said!r} is not the help of {setting.owner}.{name} "
                             f"{_clean(setting.help)!r}")
        if setting.choices and literals:
            if p.name not in literals:
                found.append(f"{where}: no dropdown (LITERALS) for a setting with fixed values {setting.choices}")
            elif (copy, p.name) not in NOT_A_SETTING and list(literals[p.name]) != list(setting.choices):
                found.append(f"{where}: dropdown {list(literals[p.name])}, {setting.owner} allows "
                             f"{list(setting.choices)}")
    return found


def shared_drifts(reg: dict[str, dict[str, Setting]]) -> list[str]:
    """Settings defined by more than one config whose help or allowed values differ."""
    found = []
    by_name: dict[str, list[Setting]] = {}
    for settings in reg.values():
        for s in settings.values():
            by_name.setdefault(s.name, []).append(s)
    for name, defs in by_name.items():
        first = defs[0]
        for other in defs[1:]:
            if other.owner == first.owner:
                continue
            if other.choices != first.choices:
                found.append(f"{name}: {first.owner} allows {first.choices}, {other.owner} {other.choices}")
    return found


def test_every_copy_of_every_setting_agrees_with_its_definition():
    reg = registry()
    problems = []
    for copy, func, configs, literals in _copies():
        problems += drifts(copy, func, configs, literals, reg)
    problems += shared_drifts(reg)
    assert problems == [], "settings that drifted from their definition:\n" + "\n".join(problems)
    names = {n for settings in reg.values() for n in settings}
    assert all(setting_name(c, n) in names for c, n in ON_PURPOSE), "ON_PURPOSE names no setting"


def test_the_service_plan_carries_the_settings_values_and_the_learner_fills_it_from_the_config():
    """The rollout plan (what the learner sends each service) names the learner's settings as RLConfig does, with
    the same allowed values (the admission rule's Literal is one type), and the learner's plan takes them from the
    run's config (sao_core/learner/loop.py builds it from config.admission_policy)."""
    from sao_core.config import field_types, literal_choices
    from sao_core.rollout.manager import RolloutPlan

    rl = settings_of(RLConfig)
    plan = field_types(RolloutPlan)
    shared = sorted(set(plan) & set(rl))
    assert {"admission", "max_staleness", "hard_staleness", "batch_size", "env_options", "max_total_tokens",
            "max_new_tokens_per_turn", "seed"} <= set(shared)
    for name in shared:
        assert literal_choices(plan[name]) == rl[name].choices, name
    policy = RLConfig(data="d", output="o", admission="fragments", max_staleness=3, hard_staleness=9,
                      batch_size=4).admission_policy()
    assert (policy.rule, policy.max_staleness, policy.hard_staleness, policy.batch_size) == ("fragments", 3, 9, 4)


def test_every_config_field_is_a_documented_setting():
    """settings_of refuses a field made without setting() (no help), so a new field cannot skip the registry."""
    reg = registry()
    assert len(reg["RLConfig"]) > 50 and all(s.help for settings in reg.values() for s in settings.values())

    @dataclasses.dataclass
    class Undocumented:
        steps: int = 3

    with pytest.raises(TypeError, match="Undocumented.steps is not defined with sao_core.config.setting"):
        settings_of(Undocumented)


def test_the_settings_tables_are_grouped_by_the_sections_of_the_definitions():
    """components/README.md and the docs' settings reference list each config's settings in one table per section
    (the section each setting names where it is defined), in the order of the --help groups."""
    from pipelines.compile import settings_markdown
    from sao_core.config import SECTIONS, sections_of

    text = settings_markdown(RLConfig)
    headings = [line for line in text.splitlines() if line.startswith("#### ")]
    assert headings == [f"#### {SECTIONS[key]} (section `{key}`)" for key in sections_of(RLConfig)]
    for name, s in settings_of(RLConfig).items():
        table = text[text.index(f"(section `{s.section}`)"):]
        table = table[:table.find("\n#### ") if "\n#### " in table else len(table)]
        assert f"| `{name}` |" in table, (name, s.section)


def test_readme_settings_tables_are_generated_from_the_registry():
    from pipelines.compile import COMPONENTS_README, readme_with_settings

    text = COMPONENTS_README.read_text()
    assert readme_with_settings(text) == text, ("components/README.md's settings tables are stale: run "
                                                "`python -m pipelines.compile --docs`")


def test_cli_help_comes_from_the_definition():
    import argparse

    from sao_core.cli import add_config_arguments

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, RLConfig)
    actions = {a.dest: a for a in parser._actions}
    admission = settings_of(RLConfig)["admission"]
    assert actions["admission"].help.startswith(admission.help.replace("%", "%%"))
    assert actions["admission"].metavar == "{" + ",".join(admission.choices) + "}"
    assert "(versions) [default: 4]" in actions["max_staleness"].help
    assert all(actions[name].help for name in settings_of(RLConfig))


def _planted(**changes):
    """A copy of sao_train's signature and docstring with `changes` planted (the KFP component untouched)."""
    from components.sao import sao_train

    func = sao_train.python_func
    reg = registry()
    params = [p.replace(default=changes.get(p.name, p.default)) for p in inspect.signature(func).parameters.values()]
    doc = inspect.getdoc(func)
    if "doc" in changes:
        old, new = changes["doc"]
        doc = doc.replace(old, new)

    def planted():
        pass
    planted.__signature__ = inspect.Signature(params)
    planted.__doc__ = doc
    return planted, reg


@pytest.mark.parametrize("kind", ["default", "type", "help", "dropdown", "optional"])
def test_the_parity_check_fails_on_a_planted_drift(kind):
    """Each kind of drift in a copy of max_staleness / admission is caught and named."""
    defaults = config_defaults(RLConfig)
    reg = registry()
    if kind == "default":
        func, _ = _planted(max_staleness=defaults["max_staleness"] + 1)
        assert drifts("sao_train", func, ("RLConfig",), {}, reg) == [
            f"sao_train.max_staleness: default {defaults['max_staleness'] + 1}, RLConfig says "
            f"{defaults['max_staleness']}"]
    elif kind == "type":
        func, _ = _planted(max_staleness=float(defaults["max_staleness"]))
        assert drifts("sao_train", func, ("RLConfig",), {}, reg) == [
            f"sao_train.max_staleness: default {float(defaults['max_staleness'])!r}, RLConfig says "
            f"{defaults['max_staleness']}"]
    elif kind == "help":
        func, _ = _planted(doc=("eps_high: DIS band upper width", "eps_high: DIS band higher width"))
        (problem,) = drifts("sao_train", func, ("RLConfig",), {}, reg)
        assert problem.startswith("sao_train.eps_high: description 'DIS band higher width")
    elif kind == "dropdown":
        import pipelines

        built = pipelines.build("sao_rl", None)
        literals = {**built.literals, "b_admission": [r for r in built.literals["b_admission"] if r != "fragments"]}
        assert drifts("sao_rl", built.func.pipeline_func, ("RLConfig", "LaunchConfig"), literals, reg) == [
            "sao_rl.b_admission: dropdown ['window', 'version_order', 'requeue', 'no_drop'], RLConfig allows "
            "['window', 'version_order', 'requeue', 'no_drop', 'fragments']"]
    else:
        from components.launch_trainjob import launch_trainjob

        func = launch_trainjob.python_func
        doc = inspect.getdoc(func).replace("(None = default 4)", "(None = default 5)")

        def planted():
            pass
        planted.__signature__ = inspect.signature(func)
        planted.__doc__ = doc
        assert drifts("launch_trainjob", planted, ("RLConfig", "LaunchConfig"), {}, reg) == [
            "launch_trainjob.max_staleness: the description says default 5, RLConfig says 4"]
