"""The documentation of the KFP surface stays true: pipelines/README.md's parameter tables equal the
compiled pipelines', and its Python and `sao kfp` examples run as written (against the loopback KFP API
server of test_kfp_client, which checks every request against the official API specification). The
examples in the project README are run too once they are there; a document whose examples repeat another's
word for word (the project README repeats pipelines/README.md's) shares that document's run."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
from test_kfp_client import FakeKFP

from pipelines.commands import compile_pipelines
from pipelines.compile import README, readme_with_tables
from sao_core.cli import main

ROOT = Path(__file__).resolve().parents[2]
HOST = "http://localhost:8080"
ALL_PACKAGES = ["post_training.yaml", "sao_rl.yaml", "evaluation.yaml"]


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def _kfp_blocks(text: str) -> list[str]:
    """The Python examples of the KFP surface (they import sao_core.kfp)."""
    return [b for b in _blocks(text, "python") if "from sao_core.kfp import" in b]


def _cli_lines(text: str) -> list[str]:
    """The `sao kfp` command lines of the shell examples."""
    return [line for block in _blocks(text, "bash") for line in block.splitlines() if line.startswith("sao kfp ")]


def _documents() -> list[Path]:
    """pipelines/README.md, and the project README when it carries the KFP examples."""
    found = [README]
    project = ROOT / "README.md"
    if any("client.connect(" in block for block in _kfp_blocks(project.read_text())):
        found.append(project)
    return found


def _example_sets(examples) -> list:
    """One pytest param per distinct list of examples (`examples(text)`), with the documents that hold exactly
    that list: the examples run once however many documents repeat them word for word."""
    holders: dict[tuple[str, ...], list[str]] = {}
    for path in _documents():
        holders.setdefault(tuple(examples(path.read_text())), []).append(os.path.relpath(path, ROOT))
    return [pytest.param(list(found), id="+".join(names)) for found, names in holders.items()]


def test_parameter_tables_are_current(tmp_path):
    packages = {p.stem: p for p in compile_pipelines(["post_training", "sao_rl", "evaluation"], tmp_path)}
    text = README.read_text()
    assert readme_with_tables(text, packages) == text, \
        "refresh with: .venv/bin/python -m pipelines.compile --golden --docs"
    assert text.count("| `a_method` | string | `\"sao\"` |") == 1


@pytest.mark.parametrize("blocks", _example_sets(_kfp_blocks))
def test_python_examples_run_as_written(blocks, tmp_path, monkeypatch):
    assert len(blocks) >= 2
    server = FakeKFP()
    monkeypatch.chdir(tmp_path)
    try:
        for block in blocks:
            exec(compile(block.replace(HOST, server.url), "documented example", "exec"), {})
        assert not server.violations, server.violations
    finally:
        server.close()
    (upload,) = server.of("UploadPipeline")
    assert upload["query"]["name"] == "sao-post-training"
    (run,) = server.of("RunService_CreateRun")
    assert run["body"]["runtime_config"]["parameters"]["a_method"] == "sao"
    (schedule,) = server.of("RecurringRunService_CreateRecurringRun")
    assert schedule["body"]["trigger"]["cron_schedule"]["cron"] == "0 0 2 * * *"
    assert schedule["body"]["no_catchup"] is True and schedule["body"]["max_concurrency"] == 1
    assert server.of("RecurringRunService_DisableRecurringRun")
    assert Path("post_training.yaml").is_file() and Path("evaluation.yaml").is_file()


@pytest.mark.parametrize("lines", _example_sets(_cli_lines))
def test_command_line_examples_run_as_written(lines, tmp_path, monkeypatch, capsys):
    assert {shlex.split(line)[2] for line in lines} >= {"compile", "upload", "run", "schedule", "schedules"}
    assert any(shlex.split(line)[2] == "compile" and "--pipeline" not in line for line in lines)
    server = FakeKFP()
    monkeypatch.chdir(tmp_path)
    try:
        for line in lines:
            code = main(shlex.split(line.replace(HOST, server.url))[1:])
            assert code == 0, (line, capsys.readouterr().err)
            if shlex.split(line)[2] == "compile" and "--pipeline" not in line:
                # without --pipeline it compiles all three and prints their paths, one a line (test_kfp_cli's
                # test_compile_with_cluster_settings compiles one pipeline only)
                printed = capsys.readouterr().out.split()
                assert [Path(p).name for p in printed] == ALL_PACKAGES and all(Path(p).is_file() for p in printed)
        assert not server.violations, server.violations
    finally:
        server.close()
    assert (tmp_path / "build" / "pipelines" / "post_training.yaml").is_file()
    assert server.of("RunService_CreateRun") and server.of("RecurringRunService_CreateRecurringRun")
