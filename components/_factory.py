"""One factory for the training components: each component's function is written from a table of its parameters.

KFP runs a lightweight component by pasting its function's source into the container (``inspect.getsource``)
and reads the UI's parameter descriptions from its docstring, so a component must be real source with its
whole signature and an ``Args:`` section. :func:`build_component` writes that source from
:class:`Parameter` rows, compiles it (kept in ``linecache``, where ``inspect.getsource`` finds generated
code) and wraps it with ``dsl.component``. A parameter that carries a config setting takes its type, default
and description from the settings registry (:func:`sao_core.config.settings_of`), so a help text is written
once, where the setting is defined.

:func:`supervised_component` builds sft_train, cpt_train, dpo_train and gkd_train: each calls
:func:`sao_core.training.trainer.train` with the method's config (``sao_core.training.config.METHOD_CONFIGS``)
and writes the run (resumable checkpoints, the exported model, metrics.jsonl) to
``OUTPUT_ROOT/RUN_ID/METHOD``; a restarted pod resumes from its newest checkpoint. The Model artifact points
at the exported model (method, step, sha256 of its manifest); ``model_uri`` is the same URI as a string for
later steps. :func:`rl_component` builds sao_train and grpo_train the same way: each calls
:func:`sao_core.learner.loop.train_rl` with a colocated rollout service. All of them start with the same
artifacts (:func:`artifact_parameters`).

A component with its own list of parameters (launch_trainjob) takes those that carry a setting from
:func:`carried_parameter`.
"""

from __future__ import annotations

import json
import linecache
import textwrap
import typing
from dataclasses import dataclass, replace

from kfp import dsl

from sao_core.config import settings_of
from sao_core.images import image
from sao_core.kfp.docs import help_sentence

#: The default of a :class:`Parameter` without one (KFP: a required input).
REQUIRED = object()
#: What the generated source may name in its signature (KFP's executor imports the same names in the pod).
_SIGNATURE_NAMES = {name: getattr(dsl, name) for name in ("Input", "Output", "Dataset", "Model", "Metrics",
                                                          "Markdown", "HTML")}
_SIGNATURE_NAMES.update(NamedTuple=typing.NamedTuple, Optional=typing.Optional)


@dataclass(frozen=True)
class Parameter:
    """One parameter of a component: `annotation` is its type as source text (``"int"``,
    ``"Input[Dataset]"``); `default` is a Python value (REQUIRED: none)."""

    name: str
    annotation: str
    description: str
    default: object = REQUIRED

    def source(self) -> str:
        """The parameter as it stands in the signature."""
        if self.default is REQUIRED:
            return f"{self.name}: {self.annotation}"
        default = json.dumps(self.default) if isinstance(self.default, str) else repr(self.default)  # "x", as typed
        return f"{self.name}: {self.annotation} = {default}"


def setting_parameter(config: type, name: str, required: bool = False) -> Parameter:
    """The parameter carrying setting `name` of `config`: its type, default and help from the registry;
    `required`: no default (the component needs a value the config's default cannot give)."""
    setting = settings_of(config)[name]
    return Parameter(name, setting.type_name(), help_sentence(setting.help),
                     REQUIRED if required or setting.required else setting.default)


def component_source(name: str, parameters: list[Parameter], returns: str, summary: str, body: str) -> str:
    """The source of component function `name`: the signature, a docstring (`summary` and one ``Args:`` line
    per parameter) and `body` (unindented text; it is indented here)."""
    signature = "".join(f"    {p.source()},\n" for p in parameters)
    args = "".join(f"        {p.name}: {p.description}\n" for p in parameters)
    code = "".join(f"    {line}\n" if line else "\n" for line in body.strip("\n").splitlines())
    return f'def {name}(\n{signature}) -> {returns}:\n    """{summary}\n\n    Args:\n{args}    """\n{code}'


def build_component(name: str, parameters: list[Parameter], returns: str, summary: str, body: str,
                    image_kind: str, module: str):
    """The KFP component `name` (a ``dsl.component`` on `image_kind`'s image) whose function is
    :func:`component_source`; `module` is the module it is published from (its ``__module__``)."""
    source = component_source(name, parameters, returns, summary, body)
    filename = f"<generated component {module}.{name}>"
    # inspect.getsource reads generated code from linecache; mtime None keeps linecache.checkcache off it
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = dict(_SIGNATURE_NAMES, __name__=module)
    # dont_inherit: KFP needs the annotations as types, not the strings this module's `annotations` future makes
    exec(compile(source, filename, "exec", dont_inherit=True), namespace)  # noqa: S102 (our own generated source)
    func = namespace[name]
    return dsl.component(func, base_image=image(image_kind), install_kfp_package=False)


#: Descriptions of parameters every training component has (none is a config setting).
OUTPUT_ROOT = "Where runs are written: s3://bucket/prefix in a cluster, a local directory for local runs."
REPORT = ("The training report (HTML): loss / reward curves with moving averages (RL: DIS masks, staleness, drops, "
          "critic, throughput), the config and the checkpoints.")
RUN_ID = "Run folder name under output_root (pipelines pass the run id; empty: a timestamp)."
#: The KFP type of each input and output a training component takes before its settings, in signature order.
_ARTIFACT_TYPES = {"data": "Input[Dataset]", "output_root": "str", "model": "Output[Model]",
                   "critic": "Output[Model]", "metrics": "Output[Metrics]", "summary": "Output[Markdown]",
                   "report": "Output[HTML]"}


def artifact_parameters(descriptions: dict[str, str], critic: bool = False) -> list[Parameter]:
    """The parameters a training component starts with: `data`, `output_root` and the outputs `model`, `critic`
    (only with `critic`), `metrics`, `summary` and `report`, each described by ``descriptions[name]``."""
    return [Parameter(name, annotation, descriptions[name]) for name, annotation in _ARTIFACT_TYPES.items()
            if critic or name != "critic"]


#: Descriptions of the supervised components' parameters that are not config settings (`data` is the method's).
SUPERVISED_DESCRIPTIONS = {
    "output_root": OUTPUT_ROOT,
    "model": "Pointer to the exported model (checkpoint_uri, sha256, method, step).",
    "metrics": "Summary numbers (losses before and after, steps, tokens, seconds).",
    "summary": "Markdown page with the summary and the loss curve.",
    "report": REPORT,
}
_BASE_MODEL = "Model to start from: embedded:tiny, a directory, an s3:// checkpoint or a hub id."
_RUN_ID = Parameter("run_id", "str", RUN_ID, "")
_OPTIONS_EXAMPLE = '{"schedule": "cosine", "warmup_steps": 10, "checkpoint_every": 100}'
#: Settings every supervised component takes as parameters of their own (the others go in `options`).
SUPERVISED_SETTINGS = ("steps", "batch_size", "lr", "max_tokens")
_SUPERVISED_BODY = '''
from sao_core.kfp import artifacts, params
from sao_core.training.trainer import train

run = artifacts.run_dir(output_root, run_id, "{method}")
config = params.training_config("{method}", data=data.path, output=run, model=base_model, steps=steps,
                                batch_size=batch_size, lr=lr, max_tokens=max_tokens, options=options{extra})
result = train("{method}", config)
model_uri, checkpoint_uri = artifacts.finish_training(result, "{method}", base_model, run, model, metrics, summary,
                                                      curve_key="loss", report_artifact=report)
return (model_uri, checkpoint_uri)  # the NamedTuple outputs, in order
'''
#: What a training component returns besides its artifacts: the model's URI and its checkpoint's.
_TRAIN_RETURNS = 'NamedTuple("{name}", model_uri=str, checkpoint_uri=str)'


def supervised_component(method: str, module: str, doc: str, data: str = "", required: tuple[str, ...] = (),
                         optional: tuple[str, ...] = (), options_example: str = _OPTIONS_EXAMPLE):
    """The `method` component (``METHOD_train``, train image) calling :func:`sao_core.training.trainer.train`.

    `module` and `doc` are the publishing module's name and docstring, whose first line (``METHOD_train: what it
    does``) is the component's description. `data` describes the dataset input ('': the method's data kind).
    `required` and `optional` name the method's own settings that get a parameter of their own (required ones
    without a default, before the defaulted ones, as KFP wants), besides :data:`SUPERVISED_SETTINGS`;
    `options_example` is a JSON object of other settings shown in the `options` description.
    """
    from sao_core.kfp.params import DATA_KIND
    from sao_core.training.config import METHOD_CONFIGS

    config = METHOD_CONFIGS[method]
    data = data or f"Prepared dataset of kind {DATA_KIND[method]}."
    parameters = [
        *artifact_parameters({**SUPERVISED_DESCRIPTIONS, "data": data}),
        *(setting_parameter(config, name, required=True) for name in required),
        Parameter("base_model", "str", _BASE_MODEL, settings_of(config)["model"].default),
        *(setting_parameter(config, name) for name in (*SUPERVISED_SETTINGS, *optional)),
        Parameter("options", "Optional[dict]", f"Any other {config.__name__} field, e.g. {options_example}.", None),
        _RUN_ID,
    ]
    extra = "".join(f",\n{' ' * 32}{name}={name}" for name in (*required, *optional))
    body = _SUPERVISED_BODY.format(method=method, extra=extra)
    returns = _TRAIN_RETURNS.format(name="TrainOutputs")
    return build_component(f"{method}_train", parameters, returns, _summary(doc), body, "train", module)


def _summary(doc: str) -> str:
    """The description line of a component module's docstring: its first line past ``NAME: ``, capitalised."""
    line = doc.strip().splitlines()[0].partition(": ")[2]
    return line[:1].upper() + line[1:]


#: Descriptions of the RL components' parameters that are not RLConfig settings (or, like `model`, are another
#: thing there); the others are described by their setting's help.
RL_DESCRIPTIONS = {
    "data": "Prepared rl dataset (prompt, reference answer or tests, environment).",
    "output_root": OUTPUT_ROOT,
    "model": "Pointer to the trained policy (checkpoint_uri, sha256, method, step, version).",
    "critic": "Pointer to the trained critic (value model).",
    "metrics": "Summary numbers (reward first/last, dropped trajectories, versions, seconds).",
    "summary": "Markdown page with the summary and the reward curve.",
    "report": REPORT,
    "run_id": RUN_ID,
}
#: The RL components' defaults that are not the registry's: a KFP pod rolls out with vLLM on its GPUs (the CLI's
#: default, hf, runs anywhere).
_RL_COMPONENT_DEFAULTS = {"engine": "vllm"}
#: The width of a generated body's lines (indented by 4 in the function: the project's 110 columns).
_BODY_WIDTH = 106
#: The body of an RL component; `{method}` is the method's name as source (a literal, or the `method` parameter).
_RL_BODY = '''
from sao_core.kfp import artifacts, params
from sao_core.learner.loop import train_rl
{check}
artifacts.quiet_http_logs()
run = artifacts.run_dir(output_root, run_id, {method})
config = params.rl_config({method}, data=data.path, output=run, model=base_model, options=options,
{settings})
result = train_rl(config)
model_uri, checkpoint_uri = artifacts.finish_training(result, {method}, base_model, run, model, metrics, summary,
                                                      curve_key="reward_mean", report_artifact=report{critic})
return (model_uri, checkpoint_uri)  # the NamedTuple outputs, in order
'''
#: The check of a GRPO-family component's `method` parameter, before anything starts.
_GRPO_METHOD_CHECK = '''from sao_core.config import ConfigError

if method not in params.GRPO_METHODS:
    raise ConfigError(f"grpo_train: method must be one of {', '.join(params.GRPO_METHODS)}, got {method!r} "
                      "(SAO has its own component, sao_train)")
'''


def rl_component(name: str, module: str, summary: str, method: str | None, settings: tuple[str, ...],
                 base_model: str, options: str, critic: bool = False):
    """The RL component `name` (rollout image) calling :func:`sao_core.learner.loop.train_rl` with a colocated
    rollout service, writing ``OUTPUT_ROOT/RUN_ID/METHOD``.

    `module` is the publishing module's name, `summary` the component's description. `method`: the RL method it
    trains; None: a GRPO-family method (:data:`sao_core.kfp.params.GRPO_METHODS`, the RL methods but sao) named by
    a `method` parameter (default grpo). `settings`: the RLConfig settings with a parameter of their own, in
    signature order, described by their help (the others go in `options`); `base_model` and `options` describe
    those parameters. `critic`: the component also outputs the critic (Model).
    """
    from sao_core.learner.config import RLConfig

    of_settings = [setting_parameter(RLConfig, setting) for setting in settings]
    parameters = [
        *artifact_parameters(RL_DESCRIPTIONS, critic=critic),
        *([] if method else [replace(setting_parameter(RLConfig, "method"), default="grpo")]),
        Parameter("base_model", "str", base_model, settings_of(RLConfig)["model"].default),
        *(replace(p, default=_RL_COMPONENT_DEFAULTS.get(p.name, p.default)) for p in of_settings),
        Parameter("options", "Optional[dict]", options, None),
        _RUN_ID,
    ]
    body = _RL_BODY.format(
        check="" if method else _GRPO_METHOD_CHECK, method=json.dumps(method) if method else "method",
        settings=textwrap.fill(", ".join(f"{setting}={setting}" for setting in settings), width=_BODY_WIDTH,
                               initial_indent=" " * 26, subsequent_indent=" " * 26),
        critic=f",\n{' ' * 54}critic_artifact=critic" if critic else "")
    returns = _TRAIN_RETURNS.format(name="RLOutputs")
    return build_component(name, parameters, returns, summary, body, "rollout", module)


#: Component parameters named otherwise than the setting they carry (parameter -> setting).
SETTING_ALIASES = {"accelerator_type": "accelerator"}


def carried_parameter(name: str, configs: tuple[type, ...], optional: bool = False) -> Parameter:
    """The parameter `name` carrying a setting of the first of `configs` that has it (:data:`SETTING_ALIASES`),
    typed, defaulted and described by the registry; `optional`: ``Optional[TYPE] = None`` instead, described as
    leaving the setting's default (``(None = default X)``)."""
    setting_name = SETTING_ALIASES.get(name, name)
    config = next(c for c in configs if setting_name in settings_of(c))
    parameter = replace(setting_parameter(config, setting_name), name=name)
    if not optional:
        return parameter
    description = f"{parameter.description.removesuffix('.')} (None = default {parameter.default})."
    return Parameter(name, f"Optional[{parameter.annotation}]", description, None)
