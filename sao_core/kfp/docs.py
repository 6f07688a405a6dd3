"""Docstrings of generated components and pipeline stages, written from the settings registry.

KFP reads the descriptions a UI shows from a function's Google-style docstring (its ``Args:`` section). A
parameter that carries a config setting is described by that setting's help (:func:`sao_core.config.settings_of`),
so the text is written once, where the setting is defined, and every copy follows it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping


def help_sentence(text: str) -> str:
    """A registry help text as a description: capitalised, ending with a full stop."""
    text = text[:1].upper() + text[1:]
    return text if text.endswith(".") else f"{text}."


def setting_description(config: type, name: str) -> str:
    """The description of setting `name` of config dataclass `config` (KeyError when it has none)."""
    from sao_core.config import settings_of

    return help_sentence(settings_of(config)[name].help)


def args_docstring(summary: str, descriptions: Mapping[str, str]) -> str:
    """A Google-style docstring: `summary`, then an ``Args:`` line per parameter, in the mapping's order."""
    args = "".join(f"    {name}: {text}\n" for name, text in descriptions.items())
    return f"{summary}\n\nArgs:\n{args}"


def described(summary: str, lookup: Callable[[str], str]) -> Callable[[Callable], Callable]:
    """Decorator: the function with an :func:`args_docstring` of its own parameters (in signature order), each
    described by ``lookup(name)``. Put it under ``dsl.component`` / ``dsl.pipeline``: KFP reads the descriptions
    from ``__doc__`` (the source KFP pastes into a component's pod needs no docstring)."""
    def decorate(func: Callable) -> Callable:
        names = list(inspect.signature(func).parameters)
        func.__doc__ = args_docstring(summary, {name: lookup(name) for name in names})
        return func

    return decorate
