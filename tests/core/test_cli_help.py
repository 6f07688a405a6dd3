"""`sao --help` for a new user: settings grouped by section, a description line per subcommand, defaults shown
as values; and `sao evaluate` fitting its token budget to the model's context (issue 40)."""

from __future__ import annotations

import argparse
import logging

import pytest

from sao_core.cli import build_parser, main, show_default


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    return capsys.readouterr().out


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _walk(child, (*path, name))


def test_train_rl_help_is_grouped_by_section(capsys):
    text = _help(["train-rl", "--help"], capsys)
    for title in ("model and data:", "optimisation:", "checkpoints and logging:", "LoRA:",
                  "RL method and objective:", "rollout services:", "staleness and admission:", "critic (sao):",
                  "weight publishing:", "evaluation during training:"):
        assert f"\n{title}\n" in text, title
    assert "\nstaleness and admission:\n  YAML section: admission\n" in text   # the key a YAML config nests under
    assert text.startswith("usage: sao train-rl [-h] [--config YAML] [--SETTING VALUE ...]\n")
    assert "\nRL with SAO or a GRPO baseline" in text          # the description line
    assert "[default: none]" in text                            # services=(): an empty tuple
    assert "()" not in text


def test_evaluate_and_train_help_are_grouped(capsys):
    text = _help(["evaluate", "--help"], capsys)
    for title in ("model and run:", "benchmarks and data:", "sampling and token budget:", "SWE-bench:",
                  "grading and LLM judge:"):
        assert f"\n{title}\n" in text, title
    assert "swe_verified,beyond_aime,imo_answerbench" in text   # a list default as a,b
    text = _help(["train", "--method", "dpo", "--help"], capsys)
    assert "\nDPO:\n" in text and "\noptimisation:\n" in text and "--method {cpt,dpo,gkd,sft}" in text


def test_every_subcommand_has_a_description_and_no_empty_tuple_default():
    for path, parser in _walk(build_parser([])):
        text = parser.format_help()
        assert "()" not in text and "[default: ]" not in text, path
        if path:
            assert parser.description and parser.description.strip(), path
            assert "\n".join(text.split("\n\n")[1:]).strip(), path


def test_show_default():
    assert show_default(0.15) == "0.15"
    assert show_default(("a", "b")) == "a,b"
    assert show_default(()) == "none"
    assert show_default({}) == "none"
    assert show_default(None) == "none"
    assert show_default("") == "''"


def test_top_level_help_tells_what_demo_runs(capsys):
    text = _help(["--help"], capsys)
    demo = text[text.index("    demo "):text.index("    kfp ")]
    assert "--pipeline" in demo and "pipeline" in demo.replace("--pipeline", "")
    assert "SAO" in demo and "make demo" in demo
    assert "data preparation and a short SFT run" not in text


def _evaluate_args(tmp_path, sao_cache, *extra):
    return ["--cache-dir", str(sao_cache), "--quiet", "evaluate", "--model", "embedded:tiny",
            "--benchmarks", "imo_answerbench", "--output", str(tmp_path / "run"), "--k", "1", "--limit", "1", *extra]


def test_evaluate_fits_the_default_budget_to_the_models_context(tmp_path, sao_cache, monkeypatch, caplog,
                                                                 capsys):
    from sao_core.eval import run

    seen = {}

    def fake_evaluate(config, progress=None, **kwargs):
        seen["config"] = config
        return {"metrics": {}, "files": {"report": "r.html", "summary": "s.json"}}

    monkeypatch.setattr(run, "evaluate", fake_evaluate)
    with caplog.at_level(logging.INFO, logger="sao_core.eval.run"):
        assert main(_evaluate_args(tmp_path, sao_cache)) == 0
    assert seen["config"].max_total_tokens == 4096       # the default 32768, lowered to embedded:tiny's context
    assert seen["config"].max_new_tokens == 4096
    lines = [r.getMessage() for r in caplog.records if "fitting the token budget" in r.getMessage()]
    assert lines == ["fitting the token budget to the model's 4096-token context: max_total_tokens 32768 -> 4096"]
    assert main(_evaluate_args(tmp_path, sao_cache, "--max-total-tokens", "2048", "--max-new-tokens", "64")) == 0
    assert seen["config"].max_total_tokens == 2048       # within the context: as given
    capsys.readouterr()


def test_evaluate_refuses_an_explicit_budget_above_the_context(tmp_path, sao_cache, capsys, monkeypatch):
    from sao_core.eval import run

    monkeypatch.setattr(run, "evaluate", lambda *a, **k: pytest.fail("must not evaluate"))
    assert main(_evaluate_args(tmp_path, sao_cache, "--max-total-tokens", "8192")) == 2
    err = capsys.readouterr().err
    assert ("sao evaluate: error: max_total_tokens 8192 (set explicitly) exceeds the context of model "
            "'embedded:tiny': 4096 tokens; set max_total_tokens to at most 4096") in err
    config = tmp_path / "eval.yaml"                         # set in the YAML file: explicit too
    config.write_text("max_total_tokens: 32768\n")
    assert main([*_evaluate_args(tmp_path, sao_cache), "--config", str(config)]) == 2
    assert "max_total_tokens 32768 (set explicitly) exceeds" in capsys.readouterr().err
    config.write_text("sampling: {max_total_tokens: 32768}\n")   # in its section: explicit as well
    assert main([*_evaluate_args(tmp_path, sao_cache), "--config", str(config)]) == 2
    assert "max_total_tokens 32768 (set explicitly) exceeds" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_config_of_plain_fields_needs_the_title_of_its_group():
    from sao_core.cli import add_config_arguments
    from sao_core.data.prepare import PrepareConfig

    with pytest.raises(ValueError, match="PrepareConfig has no settings with sections: give the title"):
        add_config_arguments(argparse.ArgumentParser(), PrepareConfig)
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, PrepareConfig, title="data preparation")
    assert "\ndata preparation:\n" in parser.format_help()
