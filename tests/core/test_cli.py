"""The `sao` command line: help for every subcommand, errors as one clear line with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sao_core import storage
from sao_core.cli import build_parser, main

SUBCOMMANDS = ["build-model", "prepare-data", "train", "rollout", "checkpoint", "demo"]


def test_top_level_help_lists_every_subcommand(capsys):
    """Checked in this process (a `sao --help` process cost ~1 s of start-up; it was test_console_script_help): the
    `sao` console script itself is started as a process by test_rollout_serve_help_and_a_real_server_process."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser(["--help"]).parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in text


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser([name, "--help"]).parse_args([name, "--help"])
    assert exit_info.value.code == 0
    assert "usage: sao " + name in capsys.readouterr().out


@pytest.mark.parametrize("method, flags", [
    ("sft", ["--data", "--steps", "--batch-size", "--lr", "--schedule", "--resume", "--config"]),
    ("dpo", ["--beta", "--reference-model"]),
    ("gkd", ["--teacher-model", "--on-policy-fraction", "--temperature"]),
])
def test_train_help_lists_the_method_fields(method, flags, capsys):
    argv = ["train", "--method", method, "--help"]
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    text = capsys.readouterr().out
    for flag in flags:
        assert flag in text
    assert "[default: 100]" in text


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


def test_a_failed_preparation_keeps_the_data_and_sao_train_refuses_it(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": f"a{i}"}]}) + "\n"
                            for i in range(30)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{oops\n' + good.read_text().splitlines()[0] + "\n")
    data = tmp_path / "data"
    assert main(["--quiet", "prepare-data", "--source", str(good), "--kind", "sft", "--output", str(data)]) == 0
    earlier = (data / "data.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["--quiet", "prepare-data", "--source", str(bad), "--kind", "sft", "--output", str(data)]) == 2
    assert "2 of 3 rows rejected" in capsys.readouterr().err
    assert (data / "data.jsonl").read_bytes() == earlier and (data / "FAILED").is_file()
    out = tmp_path / "run"
    code = main(["--quiet", "train", "--method", "sft", "--data", str(data), "--output", str(out), "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and f"dataset {data} is unusable: it has a FAILED marker" in err, err
    assert "Traceback" not in err and not (out / "metrics.jsonl").exists()


def test_prepare_data_that_writes_no_rows_exits_non_zero(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"title": "no text"}\n{"text": ""}\n')
    code = main(["--quiet", "prepare-data", "--source", str(src), "--kind", "cpt", "--output", str(tmp_path / "o"),
                 "--max-reject-fraction", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "no rows written: all 2 rows" in err and not (tmp_path / "o" / "data.jsonl").exists()


def test_prepare_data_prompt_budget_flag(tmp_path, capsys):
    src = tmp_path / "rl.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "env": "math", "answer": "1"}) + "\n"
                           for p in ("short", "y" * 81, "also short")))
    out = tmp_path / "o"
    assert main(["--quiet", "prepare-data", "--source", str(src), "--kind", "rl", "--output", str(out),
                 "--max-prompt-tokens", "10", "--max-reject-fraction", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["rejected_by_reason"] == {"prompt_too_long": 1}
    (entry,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert (entry["row"], entry["field"], entry["length"], entry["limit"]) == (1, "prompt", 81, 80)


@pytest.mark.parametrize("argv, message", [
    (["prepare-data", "--source", "x.jsonl", "--kind", "nope", "--output", "o"], "kind"),
    (["prepare-data", "--source", "/no/such/file.jsonl", "--kind", "cpt", "--output", "o"], "/no/such/file.jsonl"),
    (["prepare-data", "--kind", "cpt", "--output", "o"], "missing required field.*source"),
    (["train", "--method", "sft", "--data", "d", "--output", "o", "--steps", "ten"], "field 'steps': expected int"),
    (["train", "--method", "sft", "--data", "d", "--output", "o", "--bogus-flag", "1"], None),
    (["train", "--method", "sft", "--data", "missing", "--output", "o"], "cannot read the dataset"),
    (["train", "--method", "ppo", "--data", "d", "--output", "o"], None),
    (["train", "--method", "gkd", "--data", "d", "--output", "o"], "teacher_model is required"),
    (["train-rl", "--data", "d", "--output", "o", "--eps-high", "inf"], "field 'eps_high': expected a finite number"),
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


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "ServeConfig.port must be in [0, 65535], got 70000"),
    (["--max-batch", "0"], "ServeConfig.max_batch must be >= 1, got 0"),
    (["--lease-seconds", "-1"], "ServeConfig.lease_seconds must be > 0, got -1"),
])
def test_rollout_serve_bad_settings_are_one_line_before_anything_loads(flags, message, capsys, sao_cache):
    code = main(["--quiet", "--cache-dir", str(sao_cache), "rollout", "serve", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("sao rollout: error: ") and message in err[0], err


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


def test_train_command_end_to_end(tmp_path, capsys, sao_cache):
    from sao_core.data.synthetic import tool_arith_sft_rows

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tool_arith_sft_rows(20)))
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"data: {tmp_path / 'd'}\noutput: {tmp_path / 'run'}\nsteps: 5\nbatch_size: 4\n")
    code = main(["--quiet", "--cache-dir", str(sao_cache), "train", "--method", "sft", "--config", str(cfg),
                 "--steps", "3"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 3 and storage.is_complete_checkpoint(summary["model"])


def test_demo_small(tmp_path, sao_cache):
    from sao_core.demo import run_demo

    said = []
    result = run_demo(tmp_path / "demo", sao_cache, steps=5, train_rows=40, eval_problems=3, say=said.append)
    assert len(said) == 5 and said[-1].startswith("[5/5]")
    assert result["rows"]["imo_answerbench"] == 400 and result["model_verified"]
    assert json.loads((tmp_path / "demo" / "summary.json").read_text())["sft"]["steps"] == 5


def test_rollout_serve_help_and_a_real_server_process(tmp_path, capsys, sao_cache):
    import socket
    import time

    import httpx

    argv = ["rollout", "serve", "--help"]
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    text = capsys.readouterr().out
    for flag in ("--model", "--engine", "--port", "--max-batch", "--lease-seconds", "--plan"):
        assert flag in text
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**__import__("os").environ, "SAO_CACHE_DIR": str(sao_cache)}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "sao"), "--quiet", "rollout", "serve", "--port",
                             str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz").json()["ok"]:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(f"{url}/v1/status").json()["engine"]["engine"] == "hf"
        assert httpx.post(f"{url}/v1/shutdown", json={"grace_s": 0}).json()["shutting_down"]
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_train_refuses_a_plain_model_folder_and_trains_it_with_unverified(tmp_path, capsys, sao_cache, tiny_model_dir):
    """`--unverified` is a flag of every command that loads a model (train, train-rl, evaluate, rollout serve)."""
    import shutil

    from sao_core.data.synthetic import tool_arith_sft_rows

    plain = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, plain, ignore=shutil.ignore_patterns(storage.MANIFEST_NAME,
                                                                         storage.COMPLETE_MARKER))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tool_arith_sft_rows(8)))
    argv = ["--quiet", "--cache-dir", str(sao_cache), "train", "--method", "sft", "--data", str(tmp_path / "d"),
            "--model", str(plain), "--steps", "1", "--batch-size", "4"]
    assert main([*argv, "--output", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert f"model directory {plain} has no manifest.json" in err and "--unverified" in err
    assert main([*argv, "--output", str(tmp_path / "run"), "--unverified"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 1
    for command in (["train-rl"], ["evaluate"], ["rollout", "serve"]):
        with pytest.raises(SystemExit):
            build_parser([*command, "--help"]).parse_args([*command, "--help"])
        assert "--unverified" in capsys.readouterr().out, command
