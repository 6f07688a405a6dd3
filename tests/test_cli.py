"""The `sao` command line: help for every subcommand, errors as one clear line with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sao_core import storage
from sao_core.cli import build_parser, main

SUBCOMMANDS = ["build-model", "prepare-data", "sft", "checkpoint", "demo"]


def test_console_script_help():
    out = subprocess.run([str(Path(sys.executable).parent / "sao"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for name in SUBCOMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([name, "--help"])
    assert exit_info.value.code == 0
    assert "usage: sao " + name in capsys.readouterr().out


def test_sft_help_lists_fields_with_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sft", "--help"])
    text = capsys.readouterr().out
    for flag in ("--data", "--steps", "--batch-size", "--lr", "--schedule", "--config"):
        assert flag in text
    assert "[default: 200]" in text


def test_prepare_data_end_to_end(tmp_path, capsys):
    src = tmp_path / "cpt.jsonl"
    src.write_text('{"text": "hello"}\n{"text": "world"}\n')
    code = main(["--quiet", "prepare-data", "--source", str(src), "--kind", "cpt", "--output", str(tmp_path / "out")])
    assert code == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["rows_written"] == 2
    assert len((tmp_path / "out" / "data.jsonl").read_text().splitlines()) == 2


def test_config_file_and_override(tmp_path, capsys):
    src = tmp_path / "cpt.jsonl"
    src.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n')
    cfg = tmp_path / "prep.yaml"
    cfg.write_text(f"source: {src}\nkind: cpt\noutput: {tmp_path / 'out'}\nlimit: 1\n")
    assert main(["--quiet", "prepare-data", "--config", str(cfg), "--limit", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["rows_written"] == 2


@pytest.mark.parametrize("argv, message", [
    (["prepare-data", "--source", "x.jsonl", "--kind", "nope", "--output", "o"], "kind"),
    (["prepare-data", "--source", "/no/such/file.jsonl", "--kind", "cpt", "--output", "o"], "/no/such/file.jsonl"),
    (["prepare-data", "--kind", "cpt", "--output", "o"], "missing required field.*source"),
    (["sft", "--data", "d", "--output", "o", "--steps", "ten"], "field 'steps': expected int"),
    (["sft", "--data", "d", "--output", "o", "--bogus-flag", "1"], None),
    (["checkpoint", "latest", "/no/such/root"], None),
    (["checkpoint", "verify", "s3://"], "s3"),
])
def test_errors_are_one_clear_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["--quiet", *argv])
    except SystemExit as exit_info:  # argparse's own usage errors
        code = exit_info.code
    err = capsys.readouterr().err
    assert code in (1, 2)
    if message:
        assert "error:" in err
        import re

        assert re.search(message, err), err
    assert "Traceback" not in err


def test_build_model_and_checkpoint_commands(tmp_path, capsys, sao_cache):
    assert main(["--quiet", "--cache-dir", str(sao_cache), "build-model"]) == 0
    model_dir = capsys.readouterr().out.strip()
    assert (Path(model_dir) / "model.safetensors").is_file()
    dest = tmp_path / "ckpts" / "step-000001"
    assert main(["--quiet", "--cache-dir", str(sao_cache), "build-model", "--publish", str(dest)]) == 0
    capsys.readouterr()
    assert main(["--quiet", "checkpoint", "verify", str(dest)]) == 0
    assert "verified" in capsys.readouterr().out
    assert main(["--quiet", "checkpoint", "latest", str(tmp_path / "ckpts")]) == 0
    assert capsys.readouterr().out.strip().endswith("step-000001")
    (dest / "tokenizer.json").write_text("{}")
    assert main(["--quiet", "checkpoint", "verify", str(dest)]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    assert storage.is_complete_checkpoint(str(dest))
