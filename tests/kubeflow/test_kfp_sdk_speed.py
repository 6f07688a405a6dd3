"""sao_core.kfp.sdk_speed: the two shortcuts give the kfp SDK what it asked for, and only inside their block
(that the compiled packages keep their bytes: tests/kubeflow/test_kfp_spec.py's golden files)."""

import inspect
from pathlib import Path

import pytest
import yaml

from sao_core.kfp.sdk_speed import _stack_names, frame_caller_names, libyaml

GOLDEN = Path(__file__).resolve().parents[2] / "pipelines" / "golden" / "post_training.yaml"


def test_the_frame_names_are_the_ones_inspect_stack_gives():
    def inner():
        return [f[3] for f in _stack_names()], [f.function for f in inspect.stack()]

    ours, theirs = inner()
    assert ours == theirs and ours[:2] == ["inner", "test_the_frame_names_are_the_ones_inspect_stack_gives"]


def test_a_setter_on_a_pipeline_task_still_names_itself_and_the_module_is_given_back():
    from kfp import dsl
    from kfp.dsl import pipeline_task

    @dsl.component(base_image="python:3.11")
    def leaf() -> str:
        return "x"

    @dsl.pipeline(name="inner")
    def inner():
        leaf()

    with pytest.raises(ValueError, match="^set_accelerator_type can only be used on single-step components"):
        @dsl.pipeline(name="outer")
        def outer():
            with frame_caller_names():
                inner().set_accelerator_type("nvidia.com/gpu")
    assert pipeline_task.inspect is inspect


def test_libyaml_reads_the_same_documents_and_gives_the_loader_back():
    text = GOLDEN.read_text()
    pure = list(yaml.safe_load_all(text))
    before = yaml.safe_load_all, yaml.safe_load
    with libyaml():
        assert list(yaml.safe_load_all(text)) == pure
        assert yaml.safe_load("a: [1, 2]") == {"a": [1, 2]}
    assert (yaml.safe_load_all, yaml.safe_load) == before
