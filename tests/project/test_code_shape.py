"""Every function in sao_core stays small enough to read and change: at most MAX_LINES lines (its `def` line to
its last line; a nested function counts on its own and inside its parent) and a McCabe complexity of at most
MAX_COMPLEXITY (ruff's C901, the reference the field uses), or it is one of the exceptions that README.md names
under "Code shape", each with its reason. The README's list is the one list: the test reads it, fails on a new
offender, and fails on a listed function that no longer needs its exception (then take it off the list)."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 80
MAX_COMPLEXITY = 20

#: a README row: | `sao_core/path.py` | `function` | reason |
_ROW = re.compile(r"^\|\s*`(sao_core/[\w/]+\.py)`\s*\|\s*`([\w.]+)`\s*\|\s*(.+?)\s*\|\s*$")


def listed_exceptions() -> dict[tuple[str, str], str]:
    """(file, function) -> reason, from README.md's "Code shape" section."""
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Code shape")
    section = text[start:text.find("\n## ", start) if "\n## " in text[start:] else len(text)]
    out = {}
    for line in section.splitlines():
        match = _ROW.match(line)
        if match:
            out[(match.group(1), match.group(2))] = match.group(3)
    return out


def long_functions() -> dict[tuple[str, str], int]:
    """(file, function) -> lines, for every function in sao_core longer than MAX_LINES."""
    out = {}
    for path in sorted((ROOT / "sao_core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    out[(str(path.relative_to(ROOT)), node.name)] = lines
    return out


def complex_functions() -> dict[tuple[str, str], int]:
    """(file, function) -> McCabe complexity, for every function in sao_core above MAX_COMPLEXITY (ruff C901)."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is in the dev extra (make test-deps installs it)"
    done = subprocess.run([ruff, "check", "sao_core", "--select", "C901", "--isolated", "--output-format", "json",
                           "--config", f"lint.mccabe.max-complexity={MAX_COMPLEXITY}", "--exit-zero"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    out = {}
    for finding in json.loads(done.stdout):
        name, value = re.match(r"`(\w+)` is too complex \((\d+) >", finding["message"]).groups()
        out[(str(Path(finding["filename"]).resolve().relative_to(ROOT)), name)] = int(value)
    return out


def test_the_readme_lists_its_exceptions_with_a_reason():
    listed = listed_exceptions()
    for (file, name), reason in listed.items():
        assert (ROOT / file).exists(), f"README's Code shape lists {file}, which does not exist"
        assert len(reason.split()) >= 4, f"{file} {name}: say why it is an exception, got {reason!r}"


def test_every_function_in_sao_core_is_short_and_simple_or_a_named_exception():
    listed = listed_exceptions()
    offenders = {key: f"{lines} lines" for key, lines in long_functions().items()}
    for key, value in complex_functions().items():
        offenders[key] = ", ".join(filter(None, [offenders.get(key), f"complexity {value}"]))
    new = {f"{file} {name}: {what}" for (file, name), what in offenders.items() if (file, name) not in listed}
    assert not new, (f"over {MAX_LINES} lines or complexity {MAX_COMPLEXITY} (split it into named steps, or name it "
                     f"with a reason in README's Code shape): {sorted(new)}")
    stale = {f"{file} {name}" for (file, name) in listed if (file, name) not in offenders}
    assert not stale, f"no longer an exception (take it off README's Code shape list): {sorted(stale)}"


def test_the_measures_see_a_long_and_a_complex_function(tmp_path, monkeypatch):
    """The two measures are not blind: a 90-line function and one with 22 branches are found."""
    body = "\n".join(f"    x{i} = {i}" for i in range(89))
    branches = "\n".join(f"    if x == {i}:\n        return {i}" for i in range(22))
    package = tmp_path / "sao_core"
    package.mkdir()
    (package / "big.py").write_text(f"def long():\n{body}\n\n\ndef branchy(x):\n{branches}\n    return -1\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert long_functions() == {("sao_core/big.py", "long"): 90}
    assert complex_functions() == {("sao_core/big.py", "branchy"): 23}
