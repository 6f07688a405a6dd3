"""Two costs of the kfp SDK (pinned at 2.17.3) that compiling our pipelines pays many times, removed without
changing what the SDK produces.

- **Caller names from the whole stack.** ``PipelineTask``'s container setters (``set_accelerator_type``,
  ``set_accelerator_limit``, ...) name themselves for an error message with ``inspect.stack()[1][3]``, which
  reads the source lines and looks up the module of every frame on the stack (~100 calls in a post_training
  build, each the slower the more modules are loaded). :func:`frame_caller_names` gives that one call site the
  same names from the frames alone.
- **YAML read in pure Python.** A compiled package is re-read (to verify it loads) with ``yaml.safe_load_all``,
  PyYAML's pure-Python loader (~1 s for a 200 kB package). :func:`libyaml` points it at PyYAML's libyaml
  loader (the same documents) while a compile runs; where PyYAML was built without libyaml nothing changes.
  The writer stays the pure-Python one: libyaml's emitter folds long strings at other places (the same
  documents, other bytes, and the golden files compare bytes).

Both are scoped to a ``with`` block and undone after it. Measured on this project's 2-core machine, idle:
compiling post_training, sao_rl and evaluation in a fresh process took 5.0 s before, 3.1 s after.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import yaml


def _stack_names(context: int = 1) -> list[tuple]:
    """``inspect.stack()`` for a caller that reads only ``[i][3]``: (frame, file name, line, function name) for
    each frame from the caller outwards, without reading any source."""
    del context   # no source lines are read
    frame, out = sys._getframe(1), []
    while frame is not None:
        out.append((frame, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out


@contextlib.contextmanager
def frame_caller_names() -> Iterator[None]:
    """While the block runs, kfp's ``PipelineTask`` finds its caller's name from the frames alone (its only use
    of the ``inspect`` module is ``inspect.stack()[1][3]``)."""
    from kfp.dsl import pipeline_task

    saved = pipeline_task.inspect
    pipeline_task.inspect = types.SimpleNamespace(stack=_stack_names)
    try:
        yield
    finally:
        pipeline_task.inspect = saved


def _c_safe_load_all(stream):
    return _PY_LOAD_ALL(stream, Loader=yaml.CSafeLoader)


def _c_safe_load(stream):
    return _PY_LOAD(stream, Loader=yaml.CSafeLoader)


_PY_LOAD_ALL, _PY_LOAD = yaml.load_all, yaml.load


@contextlib.contextmanager
def libyaml() -> Iterator[None]:
    """While the block runs, ``yaml.safe_load_all`` and ``yaml.safe_load`` use libyaml's loader (when PyYAML
    has it)."""
    if not getattr(yaml, "__with_libyaml__", False):
        yield
        return
    saved = yaml.safe_load_all, yaml.safe_load
    yaml.safe_load_all, yaml.safe_load = _c_safe_load_all, _c_safe_load
    try:
        yield
    finally:
        yaml.safe_load_all, yaml.safe_load = saved
