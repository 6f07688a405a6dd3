"""The KFP run form speaks (issue 40): what the real KFP UI shows of each compiled pipeline is usable.

The UI lists a run's fields in the key order of the IR's ``root.inputDefinitions.parameters`` map, which the
compiled YAML (and the KFP API) keeps sorted by name, so the required fields must sort first. It shows no
field's description, only the pipeline's, rendered as Markdown: bare names with underscores turn into
italics there ("a_train_source and a_output_root" -> "a<em>train</em>source ..."), so every description here is
rendered with Python-Markdown's ``legacy_em`` extension (intra-word underscores are emphasis, as in the UI's
renderer) and must keep every parameter name intact. The pipeline list shows about 75 characters of the
description: its first line says what to fill in.
"""

from __future__ import annotations

import functools
import html
import re
from pathlib import Path

import markdown
import pytest
import yaml

import pipelines
from pipelines.commands import compile_pipelines

GOLDEN = Path(__file__).resolve().parents[2] / "pipelines" / "golden"
FIRST_LINE_LIMIT = 75


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("form")
    return {p.stem: p for p in compile_pipelines(list(pipelines.PIPELINES), out)}


@functools.cache
def _spec(path: Path) -> dict:
    """The pipeline spec (first document) of the package at `path`, parsed once per file: the tests only read it,
    and post_training's ~500 kB took ~1.3 s per parse in PyYAML's pure-Python loader (libyaml's gives the same
    documents, in the same key order)."""
    return next(yaml.load_all(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))


def _ui_order(path: Path) -> list[str]:
    """The fields in the order the KFP UI lists them: the parameter map's key order in the package as written."""
    return list(_spec(path)["root"]["inputDefinitions"]["parameters"])


def _rendered(text: str) -> str:
    return markdown.markdown(text, extensions=["legacy_em"])


def _text(rendered: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", rendered))


def _sources(path: Path) -> list[tuple[str, str]]:
    """(where, Markdown text) of the pipeline's description and of every parameter's."""
    spec = _spec(path)
    found = [("pipeline description", spec["pipelineInfo"]["description"])]
    for name, p in spec["root"]["inputDefinitions"]["parameters"].items():
        found.append((name, p.get("description", "")))
    return found


NAMES = list(pipelines.PIPELINES)


@pytest.mark.parametrize("name", NAMES)
def test_required_fields_come_first_in_the_ui(name, compiled):
    parameters = _spec(compiled[name])["root"]["inputDefinitions"]["parameters"]
    order = _ui_order(compiled[name])
    assert order == sorted(order), "the compiled package keeps the parameter map sorted by name"
    required = [n for n in order if not parameters[n].get("isOptional")]
    assert len(required) == 2 and order[:2] == required, order
    assert all(n.startswith("a0_") for n in required) and not any(n.startswith("a0_") for n in order[2:])
    golden = _ui_order(GOLDEN / f"{name}.yaml")
    assert golden == order, "refresh with: .venv/bin/python -m pipelines.compile --golden --docs"


@pytest.mark.parametrize("name", NAMES)
def test_every_field_is_described_and_no_optional_empty_string_looks_required(name, compiled):
    parameters = _spec(compiled[name])["root"]["inputDefinitions"]["parameters"]
    for field, p in parameters.items():
        description = p.get("description", "")
        assert description.strip(), f"{name}.{field} has no description (document it in the pipeline's Args:)"
        if p.get("isOptional"):
            assert "defaultValue" in p, field
            if p["parameterType"] == "STRING" and p["defaultValue"] == "":
                assert description.lower().startswith("optional; empty = "), (field, description)
        else:
            assert description.startswith("Required."), (field, description)


@pytest.mark.parametrize("name", NAMES)
def test_descriptions_survive_the_uis_markdown(name, compiled):
    fields = _ui_order(compiled[name])
    for where, text in _sources(compiled[name]):
        rendered = _rendered(text)
        assert "<em>" not in rendered and "<strong>" not in rendered, (where, rendered)
        visible = _text(rendered)
        for field in fields:
            if re.search(rf"\b{field}\b", text):
                assert field in visible, (where, field, visible)
                assert re.search(rf"`{field}(`|=)", text), f"{where}: write `{field}` as a code span"


@pytest.mark.parametrize("name", NAMES)
def test_the_first_line_of_the_description_says_what_to_fill_in(name, compiled):
    spec = _spec(compiled[name])
    description = spec["pipelineInfo"]["description"]
    first = description.splitlines()[0]
    assert len(first) <= FIRST_LINE_LIMIT, (len(first), first)
    required = [n for n, p in spec["root"]["inputDefinitions"]["parameters"].items() if not p.get("isOptional")]
    assert first.startswith("Required: ") and all(f"`{n}`" in first for n in required), first
    assert description.splitlines()[1] == "", "the first line is a paragraph of its own"


def test_the_markdown_check_catches_bare_names():
    """The check above is not vacuous: a bare name loses its underscores, a code span keeps them."""
    assert "<em>" in _rendered("Required: a_train_source and a_output_root.")
    assert "a_train_source" in _text(_rendered("Required: `a_train_source` and `a_output_root`."))
