"""The official SWE-bench harness (PyPI ``swebench``) as the definition of "resolved".

We run the tests in our own sandboxes (`sao_core.envs.swe_grading`); what a run *means* is decided by
the harness's own code, called here on the log we captured:

- per-repository log parsers: ``swebench.harness.log_parsers`` (``MAP_REPO_TO_PARSER_PY`` picks the
  parser by the instance's ``repo``; ``PARSER_REGISTRY`` names them);
- validity of the log and the report: ``swebench.harness.grading.get_eval_report`` (through
  ``get_logs_eval``: the start / end test-output markers, the patch-apply / timeout markers, the
  recorded exit status of the test command, "no results and no sign the suite ran"), then
  ``get_eval_tests_report`` and ``get_resolution_status`` (FAIL_TO_PASS must pass, PASS_TO_PASS must
  pass or be skipped; only ``RESOLVED_FULL`` counts as resolved);
- the markers and statuses: ``swebench.harness.constants``.

Ours (the glue): `harness_log` writes the captured test output in the form the harness's eval
script leaves in ``test_output.txt`` (start marker, output, end marker, ``>>>>> Test Exit Code: N``;
a timed-out run carries the harness's ``>>>>> Tests Timed Out`` marker, a patch that did not apply
its ``>>>>> Patch Apply Failed`` marker), `report_for_log` builds the harness's ``TestSpec`` and
calls it. A repository the harness has no parser for (a local development repository) is parsed
with the harness's generic ``parse_log_pytest``.

Importing: ``swebench/harness/__init__.py`` imports the container back ends (docker, modal) and the
data-set tools (datasets, GitPython, ...). We load only ``swebench.harness.constants``,
``.grading``, ``.log_parsers`` (and what they import: ``swebench.types``, ``swebench.utils``,
``swebench.harness.infra_failure``; third-party: ``unidiff``) by registering the
``swebench.harness`` package without running its ``__init__`` (`harness`); the package itself is
installed with ``pip install --no-deps swebench==SWEBENCH_PIN``. When ``swebench.harness`` is
already imported the normal way, that one is used.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

__all__ = [
    "FALLBACK_PARSER",
    "LEGACY_PARSER_NAMES",
    "SWEBENCH_PIN",
    "HarnessReport",
    "harness",
    "harness_log",
    "parser_for",
    "report_for_log",
    "swebench_version",
    "tests_report",
]

#: The version pyproject.toml pins (and the images install).
SWEBENCH_PIN = "5.0.2"
#: The harness parser for repositories it does not know (our choice, not the harness's).
FALLBACK_PARSER = "parse_log_pytest"
#: Short names accepted from older task metadata / options.
LEGACY_PARSER_NAMES = {"pytest": "parse_log_pytest", "django": "parse_log_django", "sympy": "parse_log_sympy"}

_INSTALL_HINT = (f"the SWE-bench grader needs the official swebench package: pip install --no-deps "
                 f"swebench=={SWEBENCH_PIN} unidiff (or pip install 'sao-kfp[train]')")
_lock = threading.Lock()
_loaded: SimpleNamespace | None = None


def swebench_version() -> str | None:
    """The installed ``swebench`` distribution's version, or None."""
    try:
        return importlib.metadata.version("swebench")
    except importlib.metadata.PackageNotFoundError:
        return None


def _harness_package() -> ModuleType:
    """``swebench.harness`` registered as a package without executing its ``__init__``."""
    existing = sys.modules.get("swebench.harness")
    if existing is not None:
        return existing
    spec = importlib.util.find_spec("swebench")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(_INSTALL_HINT)
    importlib.import_module("swebench")            # its __init__ is light (lazy attributes only)
    directory = os.path.join(next(iter(spec.submodule_search_locations)), "harness")
    pkg_spec = importlib.util.spec_from_file_location(
        "swebench.harness", os.path.join(directory, "__init__.py"), submodule_search_locations=[directory])
    if pkg_spec is None:
        raise ImportError(f"swebench.harness not found under {directory}; {_INSTALL_HINT}")
    package = importlib.util.module_from_spec(pkg_spec)
    sys.modules["swebench.harness"] = package
    return package


def harness() -> SimpleNamespace:
    """The harness modules we use: ``constants``, ``grading``, ``log_parsers``, ``python_parsers``,
    ``TestSpec`` and ``version``. Raises ImportError (with the install command) without swebench."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                _harness_package()
                constants = importlib.import_module("swebench.harness.constants")
                grading = importlib.import_module("swebench.harness.grading")
                log_parsers = importlib.import_module("swebench.harness.log_parsers")
                python_parsers = importlib.import_module("swebench.harness.log_parsers.python")
                types = importlib.import_module("swebench.types")
            except ImportError as err:
                raise ImportError(f"{err}; {_INSTALL_HINT}") from err
            _loaded = SimpleNamespace(constants=constants, grading=grading, log_parsers=log_parsers,
                                      python_parsers=python_parsers, TestSpec=types.TestSpec,
                                      version=swebench_version())
        return _loaded


def parser_for(repo: str | None, override: str | None = None) -> str:
    """The ``PARSER_REGISTRY`` name of the log parser for `repo` (``owner/name``): `override` when
    given (a registry name, or ``pytest`` / ``django`` / ``sympy``), else the harness's parser for
    the repository (``MAP_REPO_TO_PARSER_PY``), else `FALLBACK_PARSER`."""
    h = harness()
    registry = h.log_parsers.PARSER_REGISTRY
    if override:
        name = LEGACY_PARSER_NAMES.get(override, override)
        if name not in registry:
            raise ValueError(f"unknown log parser {override!r}; expected a swebench PARSER_REGISTRY name "
                             f"(e.g. {', '.join(list(registry)[:4])}, ...) or one of {', '.join(LEGACY_PARSER_NAMES)}")
        return name
    fn = h.python_parsers.MAP_REPO_TO_PARSER_PY.get((repo or "").strip())
    if fn is None:
        return FALLBACK_PARSER
    # several registry names share one function (parse_log_astropy is parse_log_pytest_v2): prefer the
    # name that spells the repository, then any name of that function
    names = [name for name, f in registry.items() if f is fn]
    short = (repo or "").split("/")[-1].replace("-", "_")
    return next((n for n in names if n == f"parse_log_{short}"), names[0] if names else FALLBACK_PARSER)


def harness_log(test_output: str, *, exit_code: int | None, timed_out: bool = False,
                patch_applied: bool = True, header: str = "") -> str:
    """`test_output` in the form of the harness's ``test_output.txt``.

    The test command's output goes between ``START_TEST_OUTPUT`` and ``END_TEST_OUTPUT``; its exit
    status follows as ``TEST_EXIT_CODE: N`` (None: not known, left out; the harness then trusts the
    log). A timed-out run gets ``TESTS_TIMEOUT`` (the harness grades such a run not resolved); a patch
    that did not apply gets ``APPLY_PATCH_FAIL`` and no test output."""
    c = harness().constants
    parts = [header.rstrip("\n")] if header else []
    if not patch_applied:
        parts.append(c.APPLY_PATCH_FAIL)
        return "\n".join(parts) + "\n"
    parts += [c.START_TEST_OUTPUT, test_output.rstrip("\n"), c.END_TEST_OUTPUT]
    if exit_code is not None:
        parts.append(f"{c.TEST_EXIT_CODE}: {int(exit_code)}")
    if timed_out:
        parts.append(c.TESTS_TIMEOUT)
    return "\n".join(parts) + "\n"


@dataclass
class HarnessReport:
    """What the harness decided about one log."""

    resolved: bool
    resolution: str                         # RESOLVED_FULL / RESOLVED_PARTIAL / RESOLVED_NO
    log_valid: bool                         # get_logs_eval's verdict on the log ("patch_successfully_applied")
    log_parser: str
    eval_type: str
    fail_to_pass_success: list[str] = field(default_factory=list)
    fail_to_pass_failure: list[str] = field(default_factory=list)
    pass_to_pass_success: list[str] = field(default_factory=list)
    pass_to_pass_failure: list[str] = field(default_factory=list)
    statuses: dict[str, str] = field(default_factory=dict)     # the parser's status map of the test output
    infra_failure_reason: str | None = None
    version: str | None = None


def _spec(instance_id: str, repo: str | None, version: str | None, f2p: Sequence[str], p2p: Sequence[str],
          parser: str) -> Any:
    h = harness()
    eval_type = (h.constants.EvalType.FAIL_ONLY if (repo or "") in h.constants.FAIL_ONLY_REPOS
                 else h.constants.EvalType.PASS_AND_FAIL)
    return h.TestSpec(instance_id=instance_id, image="", eval_script_list=[], repo=repo or "",
                      version=version or "", FAIL_TO_PASS=list(f2p), PASS_TO_PASS=list(p2p),
                      log_parser=parser, eval_type=eval_type.value)


def report_for_log(log_text: str, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str], *,
                   repo: str | None = None, log_parser: str | None = None, instance_id: str = "instance",
                   version: str | None = None, model_patch: str | None = "",
                   test_output: str | None = None) -> HarnessReport:
    """The harness's report on `log_text` (a `harness_log`): ``get_eval_report`` on the log written
    to a file, exactly as ``swebench.harness.run_evaluation`` grades ``test_output.txt``.

    `statuses` is the parser's map of the test output (`test_output`, else the whole log), for
    showing; the decision does not use it."""
    h = harness()
    parser = parser_for(repo, log_parser)
    spec = _spec(instance_id, repo, version, fail_to_pass, pass_to_pass, parser)
    prediction = {"instance_id": instance_id, "model_name_or_path": "sao", "model_patch": model_patch}
    with tempfile.TemporaryDirectory(prefix="sao-swebench-") as tmp:
        path = os.path.join(tmp, h.constants.LOG_TEST_OUTPUT)
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as fh:
            fh.write(log_text)
        result = h.grading.get_eval_report(spec, prediction, path, include_tests_status=True)[instance_id]
    tests = result.get("tests_status") or {}
    f2p = tests.get(h.constants.FAIL_TO_PASS) or {}
    p2p = tests.get(h.constants.PASS_TO_PASS) or {}
    valid = bool(result.get("patch_successfully_applied"))
    resolution = (h.grading.get_resolution_status(tests) if valid and tests
                  else h.constants.ResolvedStatus.NO.value)
    statuses = h.log_parsers.PARSER_REGISTRY[parser](test_output if test_output is not None else log_text, spec)
    return HarnessReport(
        resolved=bool(result.get("resolved")), resolution=resolution, log_valid=valid, log_parser=parser,
        eval_type=spec.eval_type,
        fail_to_pass_success=list(f2p.get("success", [])), fail_to_pass_failure=list(f2p.get("failure", [])),
        pass_to_pass_success=list(p2p.get("success", [])), pass_to_pass_failure=list(p2p.get("failure", [])),
        statuses=dict(statuses), infra_failure_reason=result.get("infra_failure_reason"), version=h.version)


def tests_report(statuses: Mapping[str, str], fail_to_pass: Sequence[str], pass_to_pass: Sequence[str],
                 repo: str | None = None) -> tuple[dict[str, Any], str]:
    """The harness's ``get_eval_tests_report`` and ``get_resolution_status`` on a status map (no log:
    none of the log-validity checks run)."""
    h = harness()
    spec = _spec("instance", repo, None, fail_to_pass, pass_to_pass, FALLBACK_PARSER)
    gold = {"instance_id": "instance", h.constants.FAIL_TO_PASS: list(fail_to_pass),
            h.constants.PASS_TO_PASS: list(pass_to_pass)}
    report = h.grading.get_eval_tests_report(dict(statuses), gold, eval_type=h.constants.EvalType(spec.eval_type))
    return report, h.grading.get_resolution_status(report)
