"""`sao demo` without ``--pipeline``: the plain SFT demo on the embedded default, on one CPU machine.

Build the embedded model, prepare an SFT data set of the synthetic tool task and the bundled
IMO-AnswerBench, fine-tune the model, publish a verified checkpoint, reload it and measure how often it
now calls the tool correctly on held-out problems. `make demo` (``sao demo --pipeline``) runs the whole
``sao_rl`` pipeline instead, with SAO and its held-out evaluation during training:
`sao_core.kfp.local.run_sao_rl_demo`.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from sao_core import storage
from sao_core.data.synthetic import tool_arith_problem, tool_arith_sft_rows

BUNDLED_IMO_ANSWERBENCH = Path(__file__).parent / "data" / "assets" / "imo_answerbench_v2.csv"


def tool_call_accuracy(model, tokenizer, problems: list[tuple[int, str, int]], max_new_tokens: int = 24) -> float:
    """Share of problems whose greedy first assistant turn is exactly ``<tool_call>calc A op B</tool_call>``."""
    import torch

    hits = 0
    for a, op, b in problems:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Compute {a} {op} {b}"}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=False)
        hits += text.split("<|im_end|>")[0].strip() == f"<tool_call>calc {a} {op} {b}</tool_call>"
    return hits / max(1, len(problems))


def held_out_problems(train_rows: int, count: int, train_seed: int = 1) -> list[tuple[int, str, int]]:
    """`count` tool_arith problems from another seed, none of them among the first `train_rows` SFT rows."""
    seen = {tuple(r["messages"][0]["content"].split()[1:]) for r in tool_arith_sft_rows(train_rows, seed=train_seed)}
    rng = random.Random(12345)
    held_out: list[tuple[int, str, int]] = []
    while len(held_out) < count:
        a, op, b = tool_arith_problem(rng)
        if (str(a), op, str(b)) not in seen:
            held_out.append((a, op, b))
    return held_out


def run_demo(output: str | Path, cache_dir: str | Path, steps: int = 300, train_rows: int = 2000,
             eval_problems: int = 50, progress: Callable[[int, dict], None] | None = None,
             say: Callable[[str], None] = print) -> dict:
    """Run the demo into `output` (a local directory); return its summary (also written as summary.json)."""
    from sao_core.data.prepare import PrepareConfig, prepare
    from sao_core.models import EMBEDDED_TINY, load_model_and_tokenizer, resolve_model
    from sao_core.training.config import SFTConfig
    from sao_core.training.trainer import train

    started = time.time()
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)

    model_dir = resolve_model(EMBEDDED_TINY, cache_dir).path
    say(f"[1/5] embedded model: {model_dir}")

    raw = out / "raw" / "tool_arith_sft.jsonl"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text("".join(json.dumps(row) + "\n" for row in tool_arith_sft_rows(train_rows, seed=1)))
    sft_data = prepare(PrepareConfig(source=str(raw), kind="sft", output=str(out / "prepared" / "tool_arith_sft"),
                                     tokenizer=model_dir, max_tokens=256))
    imo = prepare(PrepareConfig(source=str(BUNDLED_IMO_ANSWERBENCH), kind="imo_answerbench",
                                output=str(out / "prepared" / "imo_answerbench")))
    say(f"[2/5] prepared data: tool_arith sft {sft_data.rows_written} rows, IMO-AnswerBench {imo.rows_written} rows")

    held_out = held_out_problems(train_rows, eval_problems)
    base_model, tokenizer = load_model_and_tokenizer(EMBEDDED_TINY, cache_dir)
    before = tool_call_accuracy(base_model, tokenizer, held_out)

    say(f"[3/5] SFT for {steps} steps on {sft_data.rows_written} conversations")
    sft_dir = out / "sft"
    if sft_dir.exists():  # the demo starts over each time; a real run would pass resume=True instead
        shutil.rmtree(sft_dir)
    summary = train("sft", SFTConfig(data=str(out / "prepared" / "tool_arith_sft"), output=str(sft_dir),
                                     model=EMBEDDED_TINY, steps=steps, batch_size=16, lr=3e-3, warmup_steps=10,
                                     max_tokens=256, cache_dir=str(cache_dir)), progress=progress)
    say(f"[4/5] model exported and verified: {summary['model']} (resumable state: {summary['checkpoint']})")

    trained, tokenizer = load_model_and_tokenizer(summary["model"], cache_dir)
    after = tool_call_accuracy(trained, tokenizer, held_out)
    say(f"[5/5] held-out tool-call accuracy (greedy): {before:.2f} before SFT -> {after:.2f} after")

    result = {
        "output": str(out.resolve()),
        "model": model_dir,
        "prepared": {"tool_arith_sft": str(out / "prepared" / "tool_arith_sft"),
                     "imo_answerbench": str(out / "prepared" / "imo_answerbench")},
        "rows": {"tool_arith_sft": sft_data.rows_written, "imo_answerbench": imo.rows_written},
        "sft": {k: summary[k] for k in ("steps", "first_train_loss", "last_train_loss", "eval_loss_before",
                                        "eval_loss_after", "trained_tokens", "seconds")},
        "model_checkpoint": summary["model"],
        "model_verified": storage.is_complete_checkpoint(summary["model"]),
        "training_state": summary["checkpoint"],
        "held_out_tool_call_accuracy": {"before": before, "after": after, "problems": len(held_out)},
        "seconds": time.time() - started,
    }
    result["summary_file"] = str(out / "summary.json")
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
