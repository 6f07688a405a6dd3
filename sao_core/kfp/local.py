"""Run pipelines on this machine with KFP's local runner (``kfp.local.SubprocessRunner``).

Each task runs as a subprocess of the current Python interpreter (``use_venv=False``), so the
components' ``sao_core`` imports resolve to this checkout's environment; Kubernetes settings are
ignored. Artifacts land under ``pipeline_root``.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Environment for the task subprocesses: offline hub, no spin-waiting OpenMP threads.
TASK_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE",
            "TOKENIZERS_PARALLELISM": "false"}


class LocalRunError(RuntimeError):
    """A local pipeline run failed; the message names the failed task when KFP reports it."""


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Give back ``print`` and the root logger as they were before a local run.

    KFP's local runner swaps ``builtins.print`` (to indent a task's output) and the root logger's handlers (to
    stdout, INFO) around every task, saving and restoring them without a lock. A ``dsl.ParallelFor`` runs its
    iterations on two threads; when the task that started first also finishes first, the other one "restores"
    the first one's indenting print and stdout handler for good: every later ``print`` of the caller's process
    is indented and every log record goes to stdout (seen: a YAML document printed after a local evaluation
    run no longer parsed)."""
    root = logging.getLogger()
    saved_print, handlers, level = builtins.print, root.handlers[:], root.level
    try:
        yield
    finally:
        builtins.print = saved_print
        root.handlers[:] = handlers
        root.setLevel(level)


def run_pipeline(pipeline, arguments: dict[str, Any], pipeline_root: str | Path, cache_dir: str | Path | None = None,
                 threads: int | None = None, env: dict[str, str] | None = None):
    """Run `pipeline` (a ``@dsl.pipeline`` function) locally with `arguments`; return its outputs.

    Returns the pipeline's output (a single value or a dict of named outputs; None when it has none).
    `cache_dir` becomes ``SAO_CACHE_DIR`` of the tasks (models cache); `threads` sets
    ``OMP_NUM_THREADS`` (torch threads) of each task. Raises :class:`LocalRunError` if a task fails.
    """
    from kfp import local

    root = Path(pipeline_root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    values = dict(TASK_ENV)
    if cache_dir is not None:
        values["SAO_CACHE_DIR"] = str(Path(cache_dir).expanduser().resolve())
    if threads:
        values["OMP_NUM_THREADS"] = str(threads)
    values.update(env or {})
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    with _environment(values), _process_state_kept(), warnings.catch_warnings():
        # The local runner warns that our images' names do not contain "python"; it runs the tasks in this
        # interpreter, which has sao_core installed, exactly what the images hold.
        warnings.filterwarnings("ignore", message=".*non-Python base image.*", category=RuntimeWarning)
        try:
            task = pipeline(**arguments)
        except RuntimeError as err:
            raise LocalRunError(f"local run of {getattr(pipeline, 'name', pipeline)} failed: {err}") from err
    outputs = getattr(task, "outputs", None)
    if isinstance(outputs, dict) and set(outputs) == {"Output"}:
        return outputs["Output"]
    return outputs or None
