"""scripts/check_demo.py, which CI runs after `make demo`: exit 0 for a summary that shows everything, 1 naming
each claim a summary does not show, 2 for a missing or unreadable summary."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from sao_core.demo import DEMO_EVAL_EVERY, DEMO_EVAL_SAMPLES, DEMO_HELD_OUT, DEMO_MARGIN, DEMO_SAO_STEPS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_demo.py"


def _main():
    spec = importlib.util.spec_from_file_location("check_demo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _summary(before: float, after: float, steps: int = DEMO_SAO_STEPS) -> dict:
    return {"sft_model_verified": True, "sao_model_verified": True, "sao": {"steps": steps}, "pipeline_seconds": 120.0,
            "held_out": {"prompts": DEMO_HELD_OUT, "samples_per_prompt": DEMO_EVAL_SAMPLES,
                         "steps": list(range(0, DEMO_SAO_STEPS + 1, DEMO_EVAL_EVERY)),
                         "sampled_before": before, "sampled_after": after}}


def test_a_run_that_learnt_passes_and_one_that_did_not_is_named(tmp_path, capsys):
    main = _main()
    good, flat = tmp_path / "good.json", tmp_path / "flat.json"
    good.write_text(json.dumps(_summary(0.19, 0.19 + DEMO_MARGIN + 0.05)))
    flat.write_text(json.dumps(_summary(0.19, 0.22, steps=60)))
    assert main([str(good)]) == 0
    assert main([str(flat)]) == 1
    err = capsys.readouterr().err
    assert f"flat.json: expected: the held-out sampled reward rises by at least {DEMO_MARGIN} (0.190 -> 0.220)" in err
    assert f"expected: SAO ran {DEMO_SAO_STEPS} steps (ran 60)" in err


def test_a_missing_or_corrupt_summary_is_exit_2_naming_the_file(tmp_path, capsys):
    main = _main()
    assert main([str(tmp_path / "absent.json")]) == 2
    (tmp_path / "bad.json").write_text("{not json")
    assert main([str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert "absent.json" in err and "bad.json" in err
