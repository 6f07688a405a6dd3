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

What is run, per record (`harness_test_spec`):

- **harness** (a swebench 5.x row: it carries ``eval_script``, usually with ``image``,
  ``log_parser`` and ``eval_type``): the harness's ``make_test_spec`` builds the ``TestSpec`` from
  the row, and its ``TestSpec.eval_script`` (the row's script, with the harness's
  ``record_test_exit_code`` line added) is what runs in the sandbox; its whole output is the
  harness's ``test_output.txt`` and ``get_eval_report`` grades it with that ``TestSpec``. swebench
  5.x has no per-repository table of test commands any more (no ``MAP_REPO_VERSION_TO_SPECS``):
  the script comes from the row or not at all.
- **fallback** (a row without ``eval_script``, e.g. the SWE-bench Verified columns before 5.x, or a
  local development repository): our own test command (`sao_core.envs.swe_grading.runner_spec_for`),
  whose output `harness_log` wraps in the form the harness's eval script leaves in
  ``test_output.txt`` (start marker, output, end marker, ``>>>>> Test Exit Code: N``; a timed-out run
  carries the harness's ``>>>>> Tests Timed Out`` marker, a patch that did not apply its ``>>>>>
  Patch Apply Failed`` marker); `report_for_log` builds a ``TestSpec`` for the repository and calls
  ``get_eval_report``. A repository the harness has no parser for is parsed with the harness's
  generic ``parse_log_pytest``.

Importing: ``swebench/harness/__init__.py`` imports the container back ends (docker, modal) and the
data-set tools (datasets, GitPython, ...). We load only ``swebench.harness.constants``,
``.grading``, ``.log_parsers`` (and what they import: ``swebench.types``, ``swebench.utils``,
``swebench.harness.infra_failure``; third-party: ``unidiff``) by registering the
``swebench.harness`` package without running its ``__init__`` (`harness`); the package itself is
installed with ``pip install --no-deps swebench==SWEBENCH_PIN``. When ``swebench.harness`` is
already imported the normal way, that one is used. ``make_test_spec`` lives in
``swebench/harness/utils.py``, whose top level imports ``datasets``, ``dotenv`` and ``tqdm`` and
calls ``load_dotenv()`` (it reads a ``.env`` file into the environment): we do not import that
module but compile the four functions ``make_test_spec`` needs (`UTILS_FUNCTIONS`, their code
unchanged, taken from the installed file) in a namespace holding only what they refer to (``json``,
the harness's markers, ``swebench.types.TestSpec``); a name they need that we do not provide is an
ImportError. When ``swebench.harness.utils`` is already imported, its functions are used.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.metadata
import importlib.util
import json
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
    "HARNESS_ROW_FIELDS",
    "LEGACY_PARSER_NAMES",
    "SWEBENCH_PIN",
    "UTILS_FUNCTIONS",
    "HarnessReport",
    "HarnessSpec",
    "harness",
    "harness_log",
    "harness_test_spec",
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
#: The columns of a swebench 5.x row that ``make_test_spec`` reads besides the ones every SWE-bench row has.
HARNESS_ROW_FIELDS = ("eval_script", "image", "log_parser", "eval_type")
#: What we take from ``swebench/harness/utils.py`` (``make_test_spec`` and the functions it calls).
UTILS_FUNCTIONS = ("parse_eval_script", "record_test_exit_code", "_parse_image_assets", "make_test_spec")

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


def _free_names(functions: Sequence[ast.FunctionDef]) -> set[str]:
    """The global names `functions` read (neither their own locals nor builtins nor each other)."""
    loads, local = set(), {fn.name for fn in functions}
    for fn in functions:
        for node in ast.walk(fn):
            if isinstance(node, ast.Name):
                (loads if isinstance(node.ctx, ast.Load) else local).add(node.id)
            elif isinstance(node, ast.arg):
                local.add(node.arg)
    return loads - local - set(dir(builtins))


def _utils_functions(constants: ModuleType, types: ModuleType) -> SimpleNamespace:
    """`UTILS_FUNCTIONS` of the installed ``swebench/harness/utils.py``, without importing that module
    (see the module docstring): their source is compiled unchanged, under the file's name, in a
    namespace of what they refer to: ``json``, ``swebench.types.TestSpec`` and the harness's
    constants (``END_TEST_OUTPUT``, ``TEST_EXIT_CODE``, ``TEST_EXIT_CODE_VAR`` in 5.0.2)."""
    imported = sys.modules.get("swebench.harness.utils")
    if imported is not None:
        return SimpleNamespace(**{name: getattr(imported, name) for name in UTILS_FUNCTIONS})
    package = sys.modules["swebench.harness"]
    path = os.path.join(next(iter(package.__path__)), "utils.py")
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError) as err:
        raise ImportError(f"cannot read the harness's make_test_spec from {path}: {err}") from err
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in UTILS_FUNCTIONS]
    missing = sorted(set(UTILS_FUNCTIONS) - {fn.name for fn in functions})
    if missing:
        raise ImportError(f"{path} has no {', '.join(missing)}: not the swebench {SWEBENCH_PIN} harness")
    namespace: dict[str, Any] = {"__name__": "swebench.harness.utils", "json": json, "TestSpec": types.TestSpec}
    needed = _free_names(functions)
    namespace.update({name: getattr(constants, name) for name in needed if hasattr(constants, name)})
    unknown = sorted(needed - set(namespace))
    if unknown:
        raise ImportError(f"the harness's make_test_spec ({path}) refers to {', '.join(unknown)}, which we do not "
                          f"provide: not the swebench {SWEBENCH_PIN} harness")
    exec(compile(ast.Module(body=functions, type_ignores=[]), path, "exec"), namespace)
    return SimpleNamespace(**{name: namespace[name] for name in UTILS_FUNCTIONS})


def harness() -> SimpleNamespace:
    """The harness modules we use: ``constants``, ``grading``, ``log_parsers``, ``python_parsers``,
    ``TestSpec``, ``utils`` (`UTILS_FUNCTIONS`: ``make_test_spec`` ...) and ``version``. Raises
    ImportError (with the install command) without swebench."""
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
                utils = _utils_functions(constants, types)
            except ImportError as err:
                raise ImportError(f"{err}; {_INSTALL_HINT}") from err
            _loaded = SimpleNamespace(constants=constants, grading=grading, log_parsers=log_parsers,
                                      python_parsers=python_parsers, TestSpec=types.TestSpec, utils=utils,
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


@dataclass(frozen=True)
class HarnessSpec:
    """A row's ``TestSpec`` as the harness's ``make_test_spec`` built it, and what we filled in."""

    test_spec: Any                          # swebench.types.TestSpec
    derived: tuple[str, ...] = ()           # make_test_spec inputs the row lacked, filled by us (see harness_test_spec)

    @property
    def eval_script(self) -> str:
        """The script the harness runs (``/bin/bash /eval.sh`` in the instance container)."""
        return self.test_spec.eval_script


def harness_test_spec(row: Mapping[str, Any]) -> HarnessSpec | None:
    """The harness's ``TestSpec`` for a swebench 5.x `row`, or None when the row has no (non-empty)
    ``eval_script`` (then our own test commands are the fallback).

    `row` is spelled as the harness spells an instance: ``instance_id, repo, version, FAIL_TO_PASS,
    PASS_TO_PASS`` (lists or JSON strings) and the `HARNESS_ROW_FIELDS` ``eval_script, image,
    log_parser, eval_type`` (``image_assets`` too, when there). ``make_test_spec`` needs all of them; a
    row with an ``eval_script`` that lacks one of the others gets (and `HarnessSpec.derived` names it):
    ``log_parser`` the harness's parser for the repository (`parser_for`), ``eval_type``
    ``fail_only`` for the harness's ``FAIL_ONLY_REPOS`` else ``pass_and_fail``, ``image``, ``repo``
    and ``version`` an empty string (the sandbox picks the image, see
    `sao_core.envs.swe.default_sandbox_factory`). ``log_parser`` may be a ``PARSER_REGISTRY`` name
    or ``pytest`` / ``django`` / ``sympy``.

    Raises ValueError for a row whose script the harness could not grade: an ``eval_script`` without
    the harness's start / end test-output markers (``get_logs_eval`` finds no test run in its output,
    ever), an unknown ``log_parser`` or ``eval_type``."""
    script = row.get("eval_script")
    if script is None or (isinstance(script, str) and not script.strip()):
        return None
    h = harness()
    c = h.constants
    name = row.get("instance_id") or "instance"
    if not isinstance(script, str):
        raise ValueError(f"{name}: eval_script must be a string, got {type(script).__name__}")
    missing = [marker for marker in (c.START_TEST_OUTPUT, c.END_TEST_OUTPUT) if marker not in script]
    if missing:
        raise ValueError(f"{name}: the eval_script lacks the harness's marker(s) {', '.join(map(repr, missing))}: the "
                         f"harness finds no test run in the output of such a script, so it can never resolve")
    instance = dict(row)
    derived = [key for key in ("instance_id", "repo", "version", "image") if not instance.get(key)]
    for key in derived:
        instance[key] = "instance" if key == "instance_id" else ""
    repo = str(instance["repo"])
    if instance.get("log_parser"):
        try:
            instance["log_parser"] = parser_for(repo, str(instance["log_parser"]))
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    else:
        instance["log_parser"] = parser_for(repo)
        derived.append("log_parser")
    if instance.get("eval_type"):
        allowed = [t.value for t in c.EvalType]
        if instance["eval_type"] not in allowed:
            raise ValueError(f"{name}: eval_type {instance['eval_type']!r} is none of {', '.join(allowed)}")
    else:
        instance["eval_type"] = (c.EvalType.FAIL_ONLY if repo in c.FAIL_ONLY_REPOS else c.EvalType.PASS_AND_FAIL).value
        derived.append("eval_type")
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        instance.setdefault(key, [])
    return HarnessSpec(h.utils.make_test_spec(instance), tuple(derived))


def report_for_log(log_text: str, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str], *,
                   repo: str | None = None, log_parser: str | None = None, instance_id: str = "instance",
                   version: str | None = None, model_patch: str | None = "",
                   test_output: str | None = None, test_spec: Any = None) -> HarnessReport:
    """The harness's report on `log_text` (a `harness_log`, or the output of a ``TestSpec``'s eval
    script): ``get_eval_report`` on the log written to a file, exactly as
    ``swebench.harness.run_evaluation`` grades ``test_output.txt``.

    `test_spec`: the row's ``TestSpec`` (`harness_test_spec`); it then decides the parser, the tests
    and the eval type (`fail_to_pass`, `pass_to_pass`, `repo`, `log_parser`, `instance_id`,
    `version` are not used). Otherwise a ``TestSpec`` is made from those arguments.

    `statuses` is the parser's map of the test output (`test_output`, else the part of the log
    between the harness's markers, else the whole log), for showing; the decision does not use it."""
    h = harness()
    if test_spec is not None:
        spec, parser, instance_id = test_spec, test_spec.log_parser, test_spec.instance_id
    else:
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
    if test_output is None:
        start, end = h.constants.START_TEST_OUTPUT, h.constants.END_TEST_OUTPUT
        test_output = log_text.split(start, 1)[1].split(end, 1)[0] if start in log_text else log_text
    statuses = h.log_parsers.PARSER_REGISTRY[parser](test_output, spec)
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
