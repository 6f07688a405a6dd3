"""Pipeline functions made from tables of their inputs: the run forms of the pipelines and the stages' inputs.

KFP reads a pipeline's inputs from its function's signature (names, types, defaults) and their descriptions from
its docstring, then calls the function with one channel per input, in signature order. :func:`pipeline_of` makes
that function from :class:`Field` rows, so each input's type, default and description are written once, in a
table, and the function body gets the channels as one named tuple (``form.b_steps``).
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kfp import dsl

from sao_core.kfp.docs import args_docstring

#: The default of a required :class:`Field`.
REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class Field:
    """One input of a pipeline: its name, KFP type (``str``, ``dict``, ``Input[Dataset]``, ...), default
    (REQUIRED: none) and description (Markdown: the KFP UI renders it)."""

    name: str
    type: Any
    default: Any
    description: str

    @classmethod
    def required(cls, name: str, description: str) -> Field:
        """A required text input (an ``a0_`` field, listed first in the form): its description starts "Required."."""
        return cls(name, str, REQUIRED, f"Required. {description}")

    @classmethod
    def output_root(cls, written: str, layout: str) -> Field:
        """The required ``a0_output_root``: where `written` (what the runs write) goes; `layout`: what one run
        writes under it (Markdown)."""
        return cls.required("a0_output_root", f"Where {written} are written: `s3://bucket/prefix` in a cluster (a "
                                              f"local directory for local runs). Each run writes {layout}.")

    @classmethod
    def optional(cls, name: str, empty: str, description: str) -> Field:
        """A text input whose default, empty, means `empty`: "Optional; empty = EMPTY. DESCRIPTION"."""
        return cls(name, str, "", f"Optional; empty = {empty}. {description}")

    @classmethod
    def trainjob(cls, setting: str, default: int, description: str) -> Field:
        """The TrainJob shape input ``d_trainjob_SETTING`` (an int), read only with ``d_placement=trainjob``."""
        return cls(f"d_trainjob_{setting}", int, default, f"`d_placement=trainjob`: {description}")


def pipeline_of(name: str, summary: str, fields: Sequence[Field], description: str | None = None):
    """Decorator: ``func(values)`` as a ``dsl.pipeline`` `name` returning a string, whose inputs are `fields` (in
    this order) and whose docstring is `summary` and their descriptions; `values` is a named tuple of the inputs'
    channels. `description` is the pipeline's own (None: KFP takes the docstring's)."""
    values_type = collections.namedtuple("Inputs", [f.name for f in fields])

    def decorate(func: Callable) -> Any:
        def pipeline_func(*channels):
            return func(values_type(*channels))

        pipeline_func.__name__ = pipeline_func.__qualname__ = func.__name__
        pipeline_func.__signature__ = inspect.Signature(
            [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=f.type, default=f.default)
             for f in fields], return_annotation=str)
        pipeline_func.__doc__ = args_docstring(summary, {f.name: f.description for f in fields})
        return dsl.pipeline(name=name, description=description)(pipeline_func)

    return decorate


def pick(values, names: Sequence[str]) -> dict[str, Any]:
    """The inputs `names` of `values` (a :func:`pipeline_of` function's named tuple) as keyword arguments."""
    return {name: getattr(values, name) for name in names}


# ---------------------------------------------------------------------------------------- shared run-form fields
#: Benchmarks of the pipelines' final evaluation by default.
DEFAULT_EVAL_BENCHMARKS = ["swe_verified", "beyond_aime", "imo_answerbench"]
#: Run-form fields that two or more pipelines share (the same name, type, default and description), by name.
SHARED_FIELDS = {field.name: field for field in (
    Field("a_base_model", str, "embedded:tiny",
          "Model to start from: `embedded:tiny`, an `s3://` checkpoint, a directory or a Hugging Face id."),
    Field("c_eval_benchmarks", list, DEFAULT_EVAL_BENCHMARKS,
          "Benchmarks of the final evaluation: `swe_verified`, `beyond_aime`, `imo_answerbench`."),
    Field("c_eval_k", int, 4, "Samples per problem in the evaluation."),
    Field("c_eval_limit", int, 0, "Evaluate only the first N problems of each benchmark (0 = all)."),
    Field("c_eval_sandbox", str, "kubernetes",
          "Where SWE-Bench agent commands and tests run: kubernetes (one pod per episode) or local (bubblewrap "
          "in the evaluation pod)."),
    Field.optional("c_previous_summary", "no comparison", "`summary.json` of an earlier evaluation (path or "
                   "`s3://`) to compare against in the report."),
    Field("d_accelerator_type", str, "nvidia.com/gpu",
          "Kubernetes resource name of the GPUs, e.g. `nvidia.com/gpu`."),
    Field("d_eval_gpu_count", int, 1, "GPUs of each evaluation pod (0 = none)."),
    Field("d_node_selector", dict, {},
          'Node labels the GPU pods require (a TrainJob: every pod), e.g. `{"nvidia.com/gpu.product": '
          '"NVIDIA-H100-80GB-HBM3"}`.'),
    Field("d_tolerations", list, [],
          'Tolerations of the GPU pods (a TrainJob: every pod), e.g. `[{"key": "nvidia.com/gpu", "operator": '
          '"Exists"}]`.'),
    Field("d_s3_secret_name", str, "sao-s3",
          "Kubernetes Secret with the S3 credentials: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (+ "
          "`AWS_ENDPOINT_URL`, `AWS_DEFAULT_REGION`)."),
    Field.trainjob("gpus_per_node", 8,
                   "GPUs per learner node = torchrun processes per node (0: one CPU process)."),
    Field.trainjob("num_nodes", 1, "Learner nodes (pods of the node job); `torchrun --nnodes`."),
    Field.trainjob("rollout_gpus", 1,
                   "GPUs per rollout replica (vllm: `tensor_parallel_size` x `data_parallel_size`)."),
    Field.trainjob("rollout_replicas", 2, "Rollout service replicas (one pod and one Job each)."),
    Field.trainjob("tensor_parallel_size", 1, "VLLM tensor-parallel size inside one replica."),
)}


def shared_fields(*names: str) -> tuple[Field, ...]:
    """The :data:`SHARED_FIELDS` `names`, in this order."""
    return tuple(SHARED_FIELDS[name] for name in names)
