"""Every copy of an RL setting agrees with its definition (RLConfig): the defaults of the KFP components'
and the sao_rl pipeline's parameters, and the "(None = default X)" texts of the TrainJob launcher, whose
parameters are optional. A difference on purpose is listed in ON_PURPOSE with its reason; anything else
fails, naming the setting and the copy (issue 28, first part of the settings registry)."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from sao_core.learner.config import RLConfig

#: (copy, setting) -> why that copy's default differs from RLConfig's
ON_PURPOSE = {
    ("sao_train", "engine"): "a KFP pod rolls out with vLLM on its GPUs; the CLI's default hf runs anywhere",
    ("grpo_train", "engine"): "as sao_train",
    ("sao_rl", "engine"): "as sao_train",
    ("launch_trainjob", "engine"): "as sao_train",
    ("grpo_train", "method"): "the GRPO component's own method",
}


def _defaults() -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(RLConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def drifts(copy: str, func, defaults: dict[str, object]) -> list[str]:
    """The parameters of `func` named like an RLConfig field whose default (other than None) differs from the
    field's, in value or type."""
    found = []
    for p in inspect.signature(func).parameters.values():
        if p.default is None:   # optional: "None = the default", checked in the docstring (documented_drifts)
            continue
        if p.name in defaults and p.default is not inspect.Parameter.empty and (copy, p.name) not in ON_PURPOSE:
            if p.default != defaults[p.name] or type(p.default) is not type(defaults[p.name]):
                found.append(f"{copy}.{p.name}: {p.default!r}, RLConfig says {defaults[p.name]!r}")
    return found


def _same(text: str, value) -> bool:
    """Whether a default written in prose (`5e-6`, `no_drop`, `4`) is `value`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return text == str(value)


def documented_drifts(copy: str, func, defaults: dict[str, object]) -> list[str]:
    """Docstring lines `name: ... (None = default X)` whose X is not RLConfig's default of `name`."""
    found = []
    for name, said in re.findall(r"^\s*(\w+): .*?\(None = (?:the RLConfig )?default,? ([^)]+)\)",
                                 inspect.getdoc(func) or "", re.M):
        if name in defaults and not _same(said.strip(), defaults[name]):
            found.append(f"{copy}.{name}: the docstring says default {said.strip()}, RLConfig says {defaults[name]!r}")
    return found


def _copies():
    import pipelines
    from components.grpo import grpo_train
    from components.launch_trainjob import launch_trainjob
    from components.sao import sao_train

    return [("sao_train", sao_train.python_func), ("grpo_train", grpo_train.python_func),
            ("sao_rl", pipelines.build("sao_rl", None).func.pipeline_func),
            ("launch_trainjob", launch_trainjob.python_func)]


def test_component_and_pipeline_defaults_equal_rlconfig():
    defaults = _defaults()
    problems = []
    for copy, func in _copies():
        problems += drifts(copy, func, defaults) + documented_drifts(copy, func, defaults)
    assert problems == [], "settings that drifted from RLConfig:\n" + "\n".join(problems)
    assert all(name in defaults for _, name in ON_PURPOSE), "ON_PURPOSE names a setting RLConfig does not have"


@pytest.mark.parametrize("planted", ["default", "docstring"])
def test_the_parity_check_fails_on_a_planted_drift(planted):
    """A copy of max_staleness with another default, and a docstring that names another admission default."""
    defaults = _defaults()

    def drifted(max_staleness: int = defaults["max_staleness"] + 1, admission: str | None = None):
        """Args:
            admission: How the run admits episodes (None = default window)."""

    if planted == "default":
        assert drifts("planted", drifted, defaults) == [
            f"planted.max_staleness: {defaults['max_staleness'] + 1}, RLConfig says {defaults['max_staleness']}"]
    else:
        assert documented_drifts("planted", drifted, defaults) == [
            f"planted.admission: the docstring says default window, RLConfig says {defaults['admission']!r}"]
