"""Learner overhead: the SAO learner's step time against the bare forward and backward passes it needs.

On one batch, in one process (one torch thread), interleaved round by round so that load from other
processes hits every measurement alike, the script times:

- step      `Updater.step` (SAO: critic values, skip-observation GAE, K critic updates, one DIS policy update)
            in one pass over the whole padded batch (micro_batch_tokens=0)
- micro     the same `Updater.step` with length-bucketed micro-batches (`--micro-batch-tokens`, by default the
            RLConfig default): rows sorted by length, groups of at most that many padded positions
- bare      the passes the step cannot avoid: policy forward + backward (log-probs of the tokens, a token-mean
            loss), critic forward for the values (no gradient), K x critic forward + backward (MSE)
- pieces    what else the step does, timed alone: AdamW steps with gradient clipping (policy, K x critic),
            the entropy / |logp - rollout logp| statistics, GAE, the DIS loss
- unpadded  the bare passes row by row on the same trajectories without padding (what packing could save)
- loop      what the learner loop adds per step around `Updater.step`: collate, the journal entry (JSON of the
            batch's trajectories), exporting + publishing the new weights to local disk (loading them into a
            rollout service is `bench/weight_push.py`)

and reports medians, the overhead ratio step / bare, and where the rest goes. The batch is B solved tool_arith
episodes with 1 + Geometric(p_more) operations (the heavy tail of bench/async_vs_sync.py), rollout log-probs
from the policy itself; or `--journal DIR` replays the first batch of a real run's journal. Reproduce with:

    .venv/bin/python bench/learner_step.py --output local_outputs/bench/learner_step     # ~3 min on 2 idle cores
    .venv/bin/python bench/learner_step.py --quick                                        # ~40 s
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402  (sets the thread environment before torch is imported)
import torch  # noqa: E402

from sao_core import storage  # noqa: E402
from sao_core.envs.tool_arith import tool_arith_solution, tool_arith_tasks  # noqa: E402
from sao_core.learner.batch import collate, micro_batch_rows  # noqa: E402
from sao_core.learner.config import RLConfig  # noqa: E402
from sao_core.learner.updates import Updater, _policy_forward  # noqa: E402
from sao_core.objectives.common import token_logprobs  # noqa: E402
from sao_core.objectives.gae import adaptive_lambda, skip_observation_gae  # noqa: E402
from sao_core.objectives.sao import dis_policy_loss  # noqa: E402
from sao_core.rollout.trajectory import Trajectory  # noqa: E402
from sao_core.training.chat_batch import encode_chat  # noqa: E402


def solved_trajectories(policy, tokenizer, count: int, p_more: float, max_ops: int, seed: int,
                        max_tokens: int = 2048) -> list[Trajectory]:
    """`count` solved tool_arith episodes as trajectories (action tokens = assistant tokens), with rollout
    log-probs from `policy` (so the DIS ratios are ~1, as for fresh on-policy data) and random 0/1 rewards."""
    rng = random.Random(seed)
    out = []
    for task in tool_arith_tasks(count, seed=seed, p_more=p_more, max_ops=max_ops):
        enc = encode_chat(tokenizer, tool_arith_solution(task), max_tokens)
        ids = list(enc.input_ids)
        mask = list(enc.loss_mask)
        with torch.no_grad():
            logp = token_logprobs(policy(input_ids=torch.tensor([ids])).logits, torch.tensor([ids]))[0]
        out.append(Trajectory(id=f"{task.id}-0", prompt_id=task.id, env=task.env, token_ids=ids, action_mask=mask,
                              rollout_logprobs=[min(0.0, float(v)) if m else 0.0 for v, m in zip(logp, mask,
                                                                                                 strict=True)],
                              versions=[0 if m else -1 for m in mask], reward=float(rng.random() < 0.4),
                              num_turns=task.metadata["num_ops"] + 1, finish_reason="stop"))
    return out


def journal_trajectories(journal: Path, count: int) -> list[Trajectory]:
    """The first `count` trajectories of a learner journal (`<output>/journal/step-*.json`)."""
    out: list[Trajectory] = []
    for path in sorted(Path(journal).glob("step-*.json")):
        out += [Trajectory.from_dict(t) for t in json.loads(path.read_text())["trajectories"]]
        if len(out) >= count:
            return out[:count]
    if not out:
        raise SystemExit(f"no journal entries under {journal}")
    return out


def measure(args: argparse.Namespace) -> dict:
    from sao_core.models import load_model_and_tokenizer, pad_token_id, resolve_model
    from sao_core.models.value import ValueModel

    _setup.configure_torch()
    torch.manual_seed(args.seed)
    cache = _setup.default_cache_dir()
    policy, tokenizer = load_model_and_tokenizer(args.model, cache)
    critic = ValueModel.from_reference(resolve_model(args.model, cache))
    if args.journal:
        trajectories = journal_trajectories(Path(args.journal), args.batch_size)
    else:
        trajectories = solved_trajectories(policy, tokenizer, args.batch_size, args.p_more, args.max_ops, args.seed)
    config = RLConfig(data="-", output="-", method="sao", model=args.model, batch_size=len(trajectories),
                      critic_updates=args.critic_updates, critic_warmup_steps=0, policy_lr=1e-6, critic_lr=5e-6,
                      micro_batch_tokens=0)
    updater = Updater(config, policy, critic)
    # Same models, own optimisers: the weights drift a little between arms, which does not matter for timing.
    micro_updater = Updater(dataclasses.replace(config, micro_batch_tokens=args.micro_batch_tokens), policy, critic)
    batch = collate(trajectories, pad_token_id(tokenizer))
    mask = batch.action_mask
    scratch = Path(tempfile.mkdtemp(prefix="bench-learner-step-"))
    critic_params = [p for p in critic.parameters() if p.requires_grad]

    def policy_fb():
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp = token_logprobs(logits, batch.input_ids)
        (-(logp * mask).sum() / mask.sum()).backward()
        policy.zero_grad(set_to_none=True)

    rows = [collate([t], pad_token_id(tokenizer)) for t in trajectories]

    def unpadded():
        """The bare passes on each trajectory alone (no padding at all): the floor a packed learner could reach."""
        for row in rows:
            logits = policy(input_ids=row.input_ids, attention_mask=row.attention_mask).logits
            (-(token_logprobs(logits, row.input_ids) * row.action_mask).sum() / mask.sum()).backward()
            with torch.no_grad():
                critic(row.input_ids, row.attention_mask)
            for _ in range(args.critic_updates):
                values = critic(row.input_ids, row.attention_mask)
                (((values - row.rewards[:, None]) ** 2 * row.action_mask).sum() / mask.sum()).backward()
        policy.zero_grad(set_to_none=True)
        critic.zero_grad(set_to_none=True)

    def critic_values():
        with torch.no_grad():
            critic(batch.input_ids, batch.attention_mask)

    def critic_fb():
        values = critic(batch.input_ids, batch.attention_mask)
        (((values - batch.rewards[:, None]) ** 2 * mask).sum() / mask.sum()).backward()
        critic.zero_grad(set_to_none=True)

    def timed_after(prepare, fn):
        """Time `fn` alone after an untimed `prepare` (e.g. a backward pass that fills the gradients)."""
        prepare()
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began

    def fill_policy_grads():
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        (-(token_logprobs(logits, batch.input_ids) * mask).sum() / mask.sum()).backward()

    def fill_critic_grads():
        values = critic(batch.input_ids, batch.attention_mask)
        (((values - batch.rewards[:, None]) ** 2 * mask).sum() / mask.sum()).backward()

    def opt_step(optimizer, params):
        def run():
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return run

    with torch.no_grad():
        values0 = critic(batch.input_ids, batch.attention_mask)
        logp0 = token_logprobs(policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                               batch.input_ids)
    advantages0 = skip_observation_gae(batch.rewards, values0, mask, 1.0, adaptive_lambda(mask.sum(1), 1.5))[0]

    def entropy_stats():
        # the statistics `_policy_forward` computes besides the log-probs: time it minus a plain forward
        with torch.no_grad():
            _policy_forward(policy, batch)

    def plain_forward():
        with torch.no_grad():
            token_logprobs(policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                           batch.input_ids)

    def gae():
        lam = adaptive_lambda(mask.sum(dim=1), 1.5)
        skip_observation_gae(batch.rewards, values0, mask, 1.0, lam)
        skip_observation_gae(batch.rewards, values0, mask, 1.0, 1.0)

    def dis():
        dis_policy_loss(logp0, batch.rollout_logprobs, advantages0, mask, 0.3, 5.0)

    step_counter = [0]

    def step():
        updater.step(batch, step_counter[0])
        step_counter[0] += 1

    def step_micro():
        micro_updater.step(batch, step_counter[0])
        step_counter[0] += 1

    def do_collate():
        collate(trajectories, pad_token_id(tokenizer))

    def journal():
        (scratch / "journal.json").write_text(json.dumps({"step": 1, "ids": [t.id for t in trajectories],
                                                          "trajectories": [t.to_dict() for t in trajectories]}))

    def publish():
        staging = scratch / "weights"
        shutil.rmtree(staging, ignore_errors=True)
        policy.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        uri = str(scratch / "published" / f"v{step_counter[0]:06d}-{time.monotonic_ns()}")
        storage.publish_checkpoint(staging, uri, metadata={"version": 1})
        storage.checkpoint_digest(uri)
        shutil.rmtree(uri, ignore_errors=True)

    plain = {"step": step, "step_micro": step_micro, "policy_fb": policy_fb, "critic_values": critic_values, "critic_fb": critic_fb,
             "entropy_stats_with_forward": entropy_stats, "plain_forward": plain_forward, "gae": gae,
             "dis_loss": dis, "collate": do_collate, "journal": journal, "publish_weights": publish,
             "bare_unpadded": unpadded}
    after = {"policy_opt": (fill_policy_grads, opt_step(updater.policy_opt, list(policy.parameters()))),
             "critic_opt": (fill_critic_grads, opt_step(updater.critic_opt, critic_params))}
    # Warm-up (first calls allocate), then interleaved rounds in rotated order.
    for fn in plain.values():
        fn()
    for prepare, fn in after.values():
        timed_after(prepare, fn)
    samples: dict[str, list[float]] = {k: [] for k in list(plain) + list(after)}
    names = list(samples)
    load_before = _setup.conditions()
    for r in range(args.reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if name in after:
                samples[name].append(timed_after(*after[name]))
            else:
                began = time.perf_counter()
                plain[name]()
                samples[name].append(time.perf_counter() - began)
    shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    k = args.critic_updates
    bare = med["policy_fb"] + med["critic_values"] + k * med["critic_fb"]
    pieces = {"policy AdamW + clip": med["policy_opt"], f"{k} x critic AdamW + clip": k * med["critic_opt"],
              "entropy and logp-diff statistics": max(0.0, med["entropy_stats_with_forward"] - med["plain_forward"]),
              "skip-observation GAE (2 passes)": med["gae"], "DIS loss": med["dis_loss"]}
    explained = bare + sum(pieces.values())
    loop_extra = med["collate"] + med["journal"] + med["publish_weights"]
    tokens = int(batch.attention_mask.sum())
    groups = micro_batch_rows(batch.attention_mask.sum(dim=1).tolist(), args.micro_batch_tokens)
    return {
        "settings": {**vars(args), "batch_rows": len(trajectories), "padded_width": int(batch.input_ids.shape[1]),
                     "tokens": tokens, "action_tokens": int(mask.sum()),
                     "padding_share": 1 - tokens / batch.input_ids.numel(),
                     "parameters": sum(p.numel() for p in policy.parameters())},
        "conditions": {"before": load_before, "after": _setup.conditions()},
        "median_s": med, "samples_s": samples,
        "bare_s": bare, "step_s": med["step"], "overhead_ratio": med["step"] / bare,
        "pieces_s": pieces, "explained_s": explained, "unexplained_s": med["step"] - explained,
        "loop_extra_s": {"collate": med["collate"], "journal": med["journal"],
                         "publish_weights": med["publish_weights"]},
        "iteration_s": med["step"] + loop_extra, "iteration_ratio": (med["step"] + loop_extra) / bare,
        "train_tokens_per_s": tokens / med["step"],
        "bare_unpadded_s": med["bare_unpadded"], "padding_cost_ratio": bare / med["bare_unpadded"],
        "micro": {"micro_batch_tokens": args.micro_batch_tokens, "micro_batches": len(groups),
                  "padded_positions": sum(len(g) * max(int(batch.attention_mask[r].sum()) for r in g) for g in groups),
                  "step_s": med["step_micro"], "vs_bare": med["step_micro"] / bare,
                  "vs_unpadded": med["step_micro"] / med["bare_unpadded"], "vs_step": med["step_micro"] / med["step"]},
    }


def report(result: dict) -> str:
    s, med, micro = result["settings"], result["median_s"], result["micro"]
    k = s["critic_updates"]
    lines = [f"SAO learner step on B={s['batch_rows']} trajectories, padded width {s['padded_width']}, "
             f"{s['tokens']} tokens ({s['action_tokens']} action), padding {s['padding_share']:.0%}, "
             f"{s['parameters']:,} parameters, K={k}, medians of {s['reps']} interleaved rounds",
             f"conditions: load {result['conditions']['before']['loadavg_1_5_15']} -> "
             f"{result['conditions']['after']['loadavg_1_5_15']}, {result['conditions']['before']['cpu_count']} "
             f"cores, torch threads {result['conditions']['before']['torch_threads']}", ""]
    rows = [("policy forward + backward", med["policy_fb"]), ("critic forward (values, no grad)",
                                                              med["critic_values"]),
            (f"{k} x critic forward + backward", k * med["critic_fb"]), ("= bare passes", result["bare_s"])]
    rows += [(name, v) for name, v in result["pieces_s"].items()]
    rows += [("unexplained rest", result["unexplained_s"]), ("= Updater.step", result["step_s"]),
             ("collate", result["loop_extra_s"]["collate"]), ("journal entry", result["loop_extra_s"]["journal"]),
             ("export + publish weights", result["loop_extra_s"]["publish_weights"]),
             ("= learner iteration (no push to a service)", result["iteration_s"]),
             ("(bare passes row by row, no padding)", result["bare_unpadded_s"]),
             ("Updater.step with micro-batching", result["micro"]["step_s"])]
    width = max(len(n) for n, _ in rows)
    lines += [f"{'part':<{width}}  {'ms':>8}  {'x bare':>7}"]
    lines += [f"{n:<{width}}  {v * 1000:8.1f}  {v / result['bare_s']:7.2f}" for n, v in rows]
    lines += ["", f"overhead ratio Updater.step / bare = {result['overhead_ratio']:.2f} "
                  f"(learner iteration / bare = {result['iteration_ratio']:.2f}); "
                  f"{result['train_tokens_per_s']:.0f} trained tokens/s",
              f"padding: the bare passes on the padded batch take {result['padding_cost_ratio']:.2f}x the same passes "
              f"row by row without padding ({s['padding_share']:.0%} of the batch is padding)",
              f"micro-batching (micro_batch_tokens={micro['micro_batch_tokens']}: {micro['micro_batches']} micro-batches, "
              f"{micro['padded_positions']} padded positions instead of {s['batch_rows'] * s['padded_width']}): "
              f"Updater.step {micro['step_s'] * 1000:.1f} ms = {micro['vs_step']:.2f}x the one-pass step, "
              f"{micro['vs_bare']:.2f}x the bare padded passes, {micro['vs_unpadded']:.2f}x the bare passes row by row"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:tiny", help="policy (and critic) checkpoint")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--critic-updates", type=int, default=2, help="K")
    parser.add_argument("--p-more", type=float, default=0.2, help="episode operations 1 + Geometric(p_more)")
    parser.add_argument("--max-ops", type=int, default=30)
    parser.add_argument("--journal", help="replay the first batch of this learner journal directory instead")
    parser.add_argument("--micro-batch-tokens", type=int,
                        default=RLConfig.micro_batch_tokens,
                        help="budget of the micro-batched Updater.step arm (padded positions per pass)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="batch 16, 5 rounds (under a minute)")
    parser.add_argument("--output", default="local_outputs/bench/learner_step")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.reps = min(args.batch_size, 16), min(args.reps, 5)
    result = measure(args)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "learner_step.json").write_text(json.dumps(result, indent=2) + "\n")
    text = report(result)
    (out / "learner_step.txt").write_text(text + "\n")
    _plot(result, out / "learner_step.png")
    print(text)
    print(f"\nresults: {out / 'learner_step.json'}, plot: {out / 'learner_step.png'}")
    return 0


def _plot(result: dict, path: Path) -> None:
    med, k = result["median_s"], result["settings"]["critic_updates"]
    parts = {"policy fwd+bwd": med["policy_fb"], "critic values": med["critic_values"],
             f"{k}x critic fwd+bwd": k * med["critic_fb"], **result["pieces_s"],
             "unexplained": max(0.0, result["unexplained_s"])}
    series = {name: [v * 1000, None] for name, v in parts.items()}
    series["bare passes"] = [None, result["bare_s"] * 1000]
    _setup.bar_chart_png(path, f"SAO learner step: {result['overhead_ratio']:.2f}x the bare passes (median ms)",
                         ["Updater.step", "bare passes"], series, unit=" ms", stacked=True)


if __name__ == "__main__":
    sys.exit(main())
