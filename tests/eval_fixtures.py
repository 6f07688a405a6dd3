"""Fixtures for the evaluator tests: three small self-made repositories in the SWE-Bench Verified
schema, a sandbox in which their tests run, and a scripted engine.

Each repository has a bug at its base commit, a test patch that adds a failing test (FAIL_TO_PASS), its
existing tests (PASS_TO_PASS), a gold patch, a patch that fixes the bug but breaks a PASS_TO_PASS test,
and a patch that does not apply. The rows are written in the raw SWE-bench layout (``instance_id``,
``patch``, ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` as JSON strings, ...) so they go through the real loader.
The repositories live in a mirrors folder (``<owner>__<name>``), the evaluator's ``swe_repo_source``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HAVE_BWRAP = shutil.which("bwrap") is not None
BWRAP_HINT = "bubblewrap (bwrap) is not installed; install it with: apt-get update && apt-get install -y bubblewrap"
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason=BWRAP_HINT)

_GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
            "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}


@dataclass
class SweRepoCase:
    """One self-made instance: the files at the base commit, the changes of each patch (path -> new
    text), the tests, and the patches as text once the repository is built."""

    instance_id: str
    repo: str
    problem: str
    files: dict[str, str]
    gold: dict[str, str]
    test_changes: dict[str, str]
    breaking: dict[str, str]
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    broken_p2p: list[str]                 # the PASS_TO_PASS tests the breaking patch breaks
    bad_patch: str = ""                   # a patch that does not apply
    patches: dict[str, str] = field(default_factory=dict)
    base_commit: str = ""

    def row(self) -> dict:
        """The instance in the raw SWE-bench Verified layout."""
        return {
            "repo": self.repo, "instance_id": self.instance_id, "base_commit": self.base_commit,
            "patch": self.patches["gold"], "test_patch": self.patches["test"], "problem_statement": self.problem,
            "hints_text": "", "created_at": "2026-01-01T00:00:00Z", "version": "1.0",
            "FAIL_TO_PASS": json.dumps(self.fail_to_pass), "PASS_TO_PASS": json.dumps(self.pass_to_pass),
            "environment_setup_commit": self.base_commit, "difficulty": "<15 min fix",
        }


GEOMETRY = '''import math


def circle_area(r):
    return math.pi * r * r


def rect_area(w, h):
    """Area of a w x h rectangle; a negative side is an error."""
    return w * h
'''
GEOMETRY_TESTS = '''import math

from geometry.shapes import circle_area, rect_area


def test_circle():
    assert math.isclose(circle_area(2), 4 * math.pi)


def test_rect():
    assert rect_area(2, 3) == 6
'''

SLUG = '''import re


def slugify(text):
    """'Hello, World!' -> 'hello-world'"""
    words = re.findall(r"[A-Za-z0-9]+", text)
    return "-".join(words)


def truncate(text, n):
    return text if len(text) <= n else text[: n - 1] + "~"
'''
SLUG_TESTS = '''import pytest

from textkit.slug import slugify, truncate


@pytest.mark.parametrize("text,n,expected", [("short", 10, "short"), ("a long sentence", 6, "a lon~")],
                         ids=["short", "long"])
def test_truncate(text, n, expected):
    assert truncate(text, n) == expected


def test_slugify_words():
    assert slugify("a, b; c") == "a-b-c"
'''

STORE = '''class OutOfStock(Exception):
    pass


class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, qty):
        self.items[name] = self.items.get(name, 0) + qty

    def remove(self, name, qty):
        self.items[name] = self.items.get(name, 0) - qty

    def count(self, name):
        return self.items.get(name, 0)
'''
STORE_TESTS = '''from inventory.store import Inventory


class TestInventory:
    def test_add(self):
        inv = Inventory()
        inv.add("apple", 3)
        assert inv.count("apple") == 3

    def test_remove(self):
        inv = Inventory()
        inv.add("apple", 3)
        inv.remove("apple", 2)
        assert inv.count("apple") == 1
'''


def swe_cases() -> list[SweRepoCase]:
    """The three instances (fresh objects; `build_swe_repos` fills in commits and patches)."""
    return [
        SweRepoCase(
            instance_id="acme__geometry-1", repo="acme/geometry",
            problem="rect_area(-2, 3) returns -6; a rectangle with a negative side should raise ValueError.",
            files={"geometry/__init__.py": "", "geometry/shapes.py": GEOMETRY, "tests/test_shapes.py": GEOMETRY_TESTS},
            gold={"geometry/shapes.py": GEOMETRY.replace(
                "    return w * h", "    if w < 0 or h < 0:\n        raise ValueError(\"negative side\")\n    return w * h")},
            test_changes={"tests/test_shapes.py": GEOMETRY_TESTS.replace("from geometry", "import pytest\n\nfrom geometry")
                          + "\n\ndef test_rect_negative():\n    with pytest.raises(ValueError):\n        rect_area(-2, 3)\n"},
            breaking={"geometry/shapes.py": GEOMETRY.replace("return math.pi * r * r", "return math.pi * r").replace(
                "    return w * h", "    if w < 0 or h < 0:\n        raise ValueError(\"negative side\")\n    return w * h")},
            fail_to_pass=["tests/test_shapes.py::test_rect_negative"],
            pass_to_pass=["tests/test_shapes.py::test_circle", "tests/test_shapes.py::test_rect"],
            broken_p2p=["tests/test_shapes.py::test_circle"],
            bad_patch=("diff --git a/geometry/shapes.py b/geometry/shapes.py\n--- a/geometry/shapes.py\n"
                       "+++ b/geometry/shapes.py\n@@ -8,3 +8,3 @@\n def rect_area(w, h):\n-    return abs(w) * abs(h)\n"
                       "+    return max(w, 0) * max(h, 0)\n"),
        ),
        SweRepoCase(
            instance_id="acme__textkit-7", repo="acme/textkit",
            problem="slugify('Hello World') returns 'Hello-World'; slugs must be lower case ('hello-world').",
            files={"textkit/__init__.py": "", "textkit/slug.py": SLUG, "tests/test_slug.py": SLUG_TESTS},
            gold={"textkit/slug.py": SLUG.replace('return "-".join(words)', 'return "-".join(w.lower() for w in words)')},
            test_changes={"tests/test_slug.py": SLUG_TESTS + '''

@pytest.mark.parametrize("text,expected", [("Hello World", "hello-world"), ("ABC def", "abc-def")])
def test_slugify_lowercase(text, expected):
    assert slugify(text) == expected
'''},
            breaking={"textkit/slug.py": SLUG.replace('return "-".join(words)', 'return "-".join(w.lower() for w in words)')
                      .replace('text[: n - 1] + "~"', "text[:n]")},
            # ids with a space are listed as the SWE-bench harness's parser reads them: cut at the space
            fail_to_pass=["tests/test_slug.py::test_slugify_lowercase[Hello",
                          "tests/test_slug.py::test_slugify_lowercase[ABC"],
            pass_to_pass=["tests/test_slug.py::test_truncate[short]", "tests/test_slug.py::test_truncate[long]",
                          "tests/test_slug.py::test_slugify_words"],
            broken_p2p=["tests/test_slug.py::test_truncate[long]"],
            bad_patch=("diff --git a/textkit/missing.py b/textkit/missing.py\n--- a/textkit/missing.py\n"
                       "+++ b/textkit/missing.py\n@@ -1,2 +1,2 @@\n def slugify(text):\n-    return text\n"
                       "+    return text.lower()\n"),
        ),
        SweRepoCase(
            instance_id="acme__inventory-42", repo="acme/inventory",
            problem="Inventory.remove lets the stock go negative: removing 5 apples of 3 leaves -2. It should "
                    "raise OutOfStock and leave the count unchanged.",
            files={"inventory/__init__.py": "", "inventory/store.py": STORE, "tests/test_store.py": STORE_TESTS},
            gold={"inventory/store.py": STORE.replace(
                "        self.items[name] = self.items.get(name, 0) - qty",
                "        if self.items.get(name, 0) < qty:\n            raise OutOfStock(name)\n"
                "        self.items[name] = self.items.get(name, 0) - qty")},
            test_changes={"tests/test_store.py": STORE_TESTS.replace(
                "from inventory.store import Inventory", "import pytest\n\nfrom inventory.store import Inventory, OutOfStock")
                + '''
    def test_remove_too_many(self):
        inv = Inventory()
        inv.add("apple", 3)
        with pytest.raises(OutOfStock):
            inv.remove("apple", 5)
        assert inv.count("apple") == 3
'''},
            breaking={"inventory/store.py": STORE.replace(
                "        self.items[name] = self.items.get(name, 0) - qty", "        raise OutOfStock(name)")},
            fail_to_pass=["tests/test_store.py::TestInventory::test_remove_too_many"],
            pass_to_pass=["tests/test_store.py::TestInventory::test_add", "tests/test_store.py::TestInventory::test_remove"],
            broken_p2p=["tests/test_store.py::TestInventory::test_remove"],
            bad_patch="diff --git a/inventory/store.py b/inventory/store.py\n--- a/inventory/store.py\n+++ b/inventory/store.py\n"
                      "@@ -12,1 +12,1 @@ this hunk header lies about its lines\n-nothing here\n",
        ),
    ]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **_GIT_ENV}).stdout


def _diff(repo: Path, changes: dict[str, str]) -> str:
    """A git patch against HEAD that makes `changes`; the work tree is left clean."""
    for path, text in changes.items():
        (repo / path).write_text(text)
    out = git(repo, "diff")
    git(repo, "checkout", "--", *changes)
    return out


def build_swe_repos(root: Path) -> tuple[Path, list[SweRepoCase]]:
    """Create the repositories under ``root/mirrors`` and return (mirrors dir, cases with commits and
    patches filled in)."""
    mirrors = root / "mirrors"
    cases = swe_cases()
    for case in cases:
        repo = mirrors / case.repo.replace("/", "__")
        for path, text in case.files.items():
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_text(text)
        (repo / ".gitignore").write_text("__pycache__/\n")
        git(repo, "init", "-q", "-b", "main")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", "base")
        case.base_commit = git(repo, "rev-parse", "HEAD").strip()
        case.patches = {"gold": _diff(repo, case.gold), "test": _diff(repo, case.test_changes),
                        "breaking": _diff(repo, case.breaking), "bad": case.bad_patch}
        for path, text in case.gold.items():     # the upstream fix lands after the base commit
            (repo / path).write_text(text)
        git(repo, "commit", "-q", "-am", "upstream fix")
    return mirrors, cases


def write_swe_rows(path: Path, cases: list[SweRepoCase]) -> Path:
    path.write_text("".join(json.dumps(case.row()) + "\n" for case in cases))
    return path


@pytest.fixture(scope="session")
def swe_repos(tmp_path_factory):
    """(mirrors dir, cases, jsonl of the raw rows)."""
    root = tmp_path_factory.mktemp("eval-swe")
    mirrors, cases = build_swe_repos(root)
    return mirrors, cases, write_swe_rows(root / "swe_verified.jsonl", cases)


@pytest.fixture(scope="session")
def swe_sandbox_options():
    """`SWEEnv` options with which the repositories' pytest runs inside the local sandbox (the venv's
    site-packages shown read-only and on PYTHONPATH; the venv's own interpreter may sit where the
    sandbox user cannot enter)."""
    if not HAVE_BWRAP:
        pytest.skip(BWRAP_HINT)
    from sao_core.sandbox.base import SandboxLimits
    from sao_core.sandbox.local import LocalSandbox

    site = str(Path(pytest.__file__).resolve().parent.parent)
    env = {"PYTHONPATH": site, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    with LocalSandbox(SandboxLimits(wall_seconds=20), env=env, ro_paths=[site]) as box:
        for candidate in (sys.executable, "/usr/bin/python3", shutil.which("python3")):
            if candidate and box.exec([candidate, "-c", "import pytest"]).ok:
                return {"test_command": f"{candidate} -m pytest -rA -p no:cacheprovider",
                        "sandbox_options": {"env": env, "ro_paths": [site]},
                        "sandbox_limits": {"wall_seconds": 60, "cpu_seconds": 120, "memory_mb": 2048,
                                           "max_processes": 128}}
    pytest.fail(f"no python in the sandbox can import pytest from {site}")


# ------------------------------------------------------------------------------------------ scripted engine

class ScriptedEngine:
    """An `Engine` whose "model" replays scripted turns: `script` maps a sampling seed (the runner
    derives one per benchmark, problem and sample, `sao_core.eval.run.sample_seed`) to the list of
    texts of that sample's turns; each `generate` call of that sample (turn t comes with the seed
    `turn_seed(seed, t)`, as from the real run_episode) returns the next turn, encoded
    with the real tokenizer and ended with its end-of-turn token (cut at ``max_new_tokens`` like a real
    engine). Unknown seeds answer `default`; `delays` (seed -> seconds) slows chosen samples down.
    Everything else of the evaluation (environments, sandboxes, graders, metrics, report) is real."""

    def __init__(self, tokenizer, script: dict[int, list[str]], default: str = "I do not know.",
                 delays: dict[int, float] | None = None):
        self.tokenizer = tokenizer
        self.script = {seed: list(turns) for seed, turns in script.items()}
        self.default = default
        self.delays = dict(delays or {})
        self.version = 0
        self.eos_token_ids = (tokenizer.eos_token_id,)
        self.calls: list[int] = []
        self.closed = False

    async def generate(self, prompt_ids, params):
        from sao_core.rollout.engines.base import Generation

        seed = self._sample_seed(params.seed)
        self.calls.append(seed)
        turns = self.script.get(seed)
        text = turns.pop(0) if turns else self.default
        if self.delays.get(seed):
            await asyncio.sleep(self.delays[seed])
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        finish = "stop"
        if len(ids) >= params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        else:
            ids.append(self.tokenizer.eos_token_id)
        started = time.monotonic()
        return Generation(ids, [0.0] * len(ids), [0] * len(ids), finish, seconds=time.monotonic() - started)

    def _sample_seed(self, seed):
        """The sample seed behind a turn's seed (scripted or delayed samples; others stay as they are)."""
        from sao_core.rollout.episode import turn_seed

        for known in (*self.script, *self.delays):
            if seed == known or any(turn_seed(known, t) == seed for t in range(1, 64)):
                return known
        return seed

    async def load_weights(self, model_dir, version):
        raise NotImplementedError("a scripted engine has no weights")

    async def pause(self):
        return None

    async def resume(self):
        return None

    async def close(self):
        self.closed = True

    def stats(self):
        return {"engine": "scripted", "calls": len(self.calls)}


# ------------------------------------------------------------------------------------------ LLM judge server

#: one tagged block of the judge's user message: <<<NAME tag>>> ... <<<END NAME tag>>>
_JUDGE_BLOCK = re.compile(r"^<<<(?P<name>[A-Z ]+) (?P<tag>[0-9a-f]{16})>>>\n(?P<text>.*?)\n<<<END (?P=name) (?P=tag)>>>$",
                          re.MULTILINE | re.DOTALL)


class JudgeServer:
    """A small OpenAI-compatible ``/v1/chat/completions`` server on 127.0.0.1 (real HTTP, in a thread).

    Its "model" reads the reference and the candidate answer from the user message's tagged blocks (the
    layout of `sao_core.eval.graders.JUDGE_USER`) and ends with ``VERDICT: EQUIVALENT`` when the candidate,
    lower-cased without ``$`` and spaces, is listed in `equivalents[reference]` (else ``NOT_EQUIVALENT``).
    Candidates that start with a keyword misbehave:
    ``FLAKY`` (HTTP 503 the first time), ``NOVERDICT`` (a reply without a verdict), ``BROKEN`` (a body
    that is not JSON), ``REFUSE`` (HTTP 400). Every request is kept in `requests` (body and headers)."""

    def __init__(self, equivalents: dict[str, list[str]]):
        from fake_http import FakeServer

        self.equivalents = {ref: {_squash(a) for a in answers} for ref, answers in equivalents.items()}
        self.requests: list[dict] = []
        self._flaked: set[str] = set()
        self.server = FakeServer(self._answer)
        self.url = f"{self.server.url}/v1"

    def _answer(self, request):
        body = request.json()
        self.requests.append({"path": request.path, "body": body, "headers": request.headers})
        status, payload = self.respond(request.path, body)
        return status, payload, "application/json"

    def respond(self, path: str, body: dict) -> tuple[int, object]:
        if path != "/v1/chat/completions":
            return 404, {"error": f"no route {path}"}
        blocks = {m["name"]: m["text"] for m in _JUDGE_BLOCK.finditer(body["messages"][-1]["content"])}
        reference, answer = blocks["REFERENCE ANSWER"], blocks["CANDIDATE ANSWER"]
        if answer.startswith("FLAKY") and answer not in self._flaked:
            self._flaked.add(answer)
            return 503, {"error": "overloaded, try again"}
        if answer.startswith("BROKEN"):
            return 200, b"<html>not json</html>"
        if answer.startswith("REFUSE"):
            return 400, {"error": "bad request"}
        if answer.startswith("NOVERDICT"):
            text = "I am not sure."
        else:
            ok = _squash(answer.removeprefix("FLAKY")) in self.equivalents.get(reference, set())
            text = f"<think>Compare {answer!r} with {reference!r}.</think>\nThey are {'equivalent' if ok else 'different'}.\n" \
                   f"VERDICT: {'EQUIVALENT' if ok else 'NOT_EQUIVALENT'}"
        return 200, {"id": "cmpl-1", "object": "chat.completion", "model": body.get("model"),
                     "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]}

    def close(self) -> None:
        self.server.stop()


def _squash(text: str) -> str:
    return text.replace("$", "").replace(" ", "").lower()


@pytest.fixture
def judge_server():
    server = JudgeServer({"odd $n$": ["all odd n", "n odd", "every odd integer n"],
                          "$2^{k}$": ["all powers of two"], "3": ["three"]})
    yield server
    server.close()


@pytest.fixture(scope="module")
def imo():
    """The IMO-AnswerBench rule grader with its math-verify workers (module-scoped)."""
    from sao_core.envs.grading import MathGrader
    from sao_core.eval.graders import ImoGrader

    with MathGrader(max_workers=2, timeout_s=5) as grader:
        yield ImoGrader(grader, timeout_s=5)


@pytest.fixture(scope="module")
def imo_records():
    """The real IMO-AnswerBench v2 records (the bundled data set)."""
    from sao_core.eval.benchmarks import get_benchmark, load_benchmark

    return load_benchmark(get_benchmark("imo_answerbench")).records
