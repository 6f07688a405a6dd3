"""Peak memory and seconds of one SAO learner step at a real vocabulary, before and after the chunked output layer.

    python bench/learner_memory.py [--tokens 2048,8192,32768] [--vocabs 32000,151936] [--out bench/results/learner_memory.json]
    python bench/learner_memory.py --tokens 256 --row-tokens 128 --vocabs 1000 --threads 1   # a smoke run, seconds

One SAO learner step = the policy forward + backward over the action tokens, the critic's values, and K = 2
critic updates (`learner.updates.Updater.step`, float32 on CPU), on a random-initialised Llama-style model of
hidden size 256 and 2 layers (no tokenizer needed), rows of 1,024 action tokens (`--row-tokens`) after a
32-token prompt.
"before" runs the policy forward of the previous release (full [B, T, V] logits: `token_logprobs` plus a
float32 log-softmax for the entropy); "after" the current code. Each configuration runs in its own process
(peak resident memory = ru_maxrss). The step's seconds are compared with its bare passes: the same forward /
backward passes and optimiser updates run directly (critic values, K critic updates, one policy update),
without the learner's bookkeeping (GAE, losses, masks, micro-batch grouping, metrics).
A "before" configuration whose full logits would exceed `--max-logits-gb` is not run (its size is reported).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import _setup

ROOT = Path(__file__).resolve().parents[1]
ROW_ACTIONS, PROMPT = 1024, 32
HIDDEN, LAYERS = 256, 2


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def legacy_policy_forward(policy, batch):
    """The policy forward of the previous release: full logits, float32 log-softmax for the entropy."""
    import torch

    from sao_core.objectives.common import token_logprobs

    logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = token_logprobs(logits, batch.input_ids)
    mask = batch.action_mask.bool()
    with torch.no_grad():
        shifted = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        entropy = -(shifted.exp() * shifted).sum(-1)
        entropy = torch.cat([entropy.new_zeros(entropy.shape[0], 1), entropy], dim=1)
        diff = (logp.detach() - batch.rollout_logprobs).abs()[mask]
        stats = {"entropy": float(entropy[mask].mean()), "logp_diff_mean": float(diff.mean()),
                 "logp_diff_max": float(diff.max())}
    return logp, stats


def worker(mode: str, vocab: int, tokens: int, row_actions: int = ROW_ACTIONS) -> dict:
    """One configuration's step and bare passes on `tokens // row_actions` rows of `row_actions` action tokens
    (after a PROMPT-token prompt each) at vocabulary `vocab`; returns its row of the report."""
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import sao_core.learner.updates as updates
    from sao_core.learner.batch import collate
    from sao_core.learner.config import RLConfig
    from sao_core.models.value import ValueModel
    from sao_core.rollout.trajectory import Trajectory
    from sao_core.training.core import clip_and_step

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    policy = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as tmp:
        policy.save_pretrained(tmp)
        critic = ValueModel.from_pretrained(tmp)
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(tokens // row_actions):
        ids = torch.randint(2, vocab, (PROMPT + row_actions,), generator=g).tolist()
        mask = [0] * PROMPT + [1] * row_actions
        rows.append(Trajectory(id=f"t{i}", prompt_id=f"p{i}", env="tool_arith", token_ids=ids, action_mask=mask,
                               rollout_logprobs=[-12.0 if m else 0.0 for m in mask],
                               versions=[0 if m else -1 for m in mask], reward=float(i % 2), num_turns=1,
                               finish_reason="stop", metadata={"epoch": 0}))
    batch = collate(rows, 0)
    if mode == "before":
        updates._policy_forward = legacy_policy_forward
    rl = RLConfig(data="unused", output="unused", method="sao", batch_size=len(rows), critic_warmup_steps=0,
                  eps_low=0.9, eps_high=1e6)
    updater = updates.Updater(rl, policy, critic)
    micro = updater._micro_batches(batch)

    def bare_passes() -> None:
        """The step's passes and optimiser updates, nothing else: the critic's values, K critic updates, one
        policy update (GAE, losses, masks, micro-batch bookkeeping and metrics left out)."""
        with torch.no_grad():
            for _, mb, _ in micro:
                critic(mb.input_ids, mb.attention_mask)
        for _ in range(rl.critic_updates):
            for _, mb, _ in micro:
                (critic(mb.input_ids, mb.attention_mask) * mb.action_mask).sum().backward()
            clip_and_step(updater.critic_opt, critic.parameters(), rl.grad_clip)
        for _, mb, _ in micro:
            logp, _ = updates._policy_forward(policy, mb)
            (logp * mb.action_mask).sum().backward()
        clip_and_step(updater.policy_opt, policy.parameters(), rl.grad_clip)

    # Warm-up on one row (first-call costs), then the step, then its bare passes on the same micro-batches.
    first = micro[0][1].select([0])
    logp, _ = updates._policy_forward(policy, first)
    logp.sum().backward()
    (critic(first.input_ids, first.attention_mask)).sum().backward()
    policy.zero_grad(set_to_none=True)
    critic.zero_grad(set_to_none=True)
    base = rss_mb()
    began = time.perf_counter()
    metrics, _ = updater.step(batch, 0)
    step_s = time.perf_counter() - began
    peak = rss_mb()
    began = time.perf_counter()
    bare_passes()
    bare_s = time.perf_counter() - began
    return {"mode": mode, "vocab": vocab, "action_tokens": int(batch.action_mask.sum()), "base_rss_mb": round(base),
            "peak_rss_mb": round(peak), "step_s": round(step_s, 2), "bare_passes_s": round(bare_s, 2),
            "step_over_bare": round(step_s / bare_s, 3), "micro_batches": len(micro),
            "entropy": round(metrics["entropy"], 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="2048,8192,32768")
    parser.add_argument("--vocabs", default="32000,151936")
    parser.add_argument("--modes", default="before,after")
    parser.add_argument("--max-logits-gb", type=float, default=2.0,
                        help="skip a 'before' run whose one float32 [N, V] logits tensor exceeds this (it holds ~4)")
    parser.add_argument("--row-tokens", type=int, default=ROW_ACTIONS,
                        help="action tokens per row (default 1024); each row has a 32-token prompt besides")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "learner_memory.json"))
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "VOCAB", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), int(args.worker[2]), args.row_tokens)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    results = []
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        for tokens in [int(t) for t in args.tokens.split(",")]:
            for mode in args.modes.split(","):
                logits_gb = (tokens + tokens // args.row_tokens * PROMPT) * vocab * 4 / 1e9
                if mode == "before" and logits_gb > args.max_logits_gb:
                    row = {"mode": mode, "vocab": vocab, "action_tokens": tokens, "skipped":
                           f"one float32 [N, V] logits tensor is {logits_gb:.1f} GB (the step holds about four)"}
                else:
                    done = subprocess.run([sys.executable, __file__, "--worker", mode, str(vocab), str(tokens),
                                           "--row-tokens", str(args.row_tokens)], env=env, capture_output=True,
                                          text=True)
                    if done.returncode != 0:
                        row = {"mode": mode, "vocab": vocab, "action_tokens": tokens,
                               "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
                    else:
                        row = json.loads(done.stdout.strip().splitlines()[-1])
                print(json.dumps(row), flush=True)
                results.append(row)
    slopes = {}
    for vocab in {r["vocab"] for r in results}:
        after = sorted((r for r in results if r["vocab"] == vocab and r["mode"] == "after" and "peak_rss_mb" in r),
                       key=lambda r: r["action_tokens"])
        if len(after) >= 2:
            slopes[str(vocab)] = round((after[-1]["peak_rss_mb"] - after[0]["peak_rss_mb"])
                                       / ((after[-1]["action_tokens"] - after[0]["action_tokens"]) / 1000), 1)
    report = {"conditions": _setup.conditions(), "hidden": HIDDEN, "layers": LAYERS,
              "row_action_tokens": args.row_tokens, "results": results, "after_mb_per_1k_tokens": slopes}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print("MB per 1k action tokens (after):", slopes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
