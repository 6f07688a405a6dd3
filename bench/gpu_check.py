"""GPU check kit: the project's HF engine and SAO learner step on a real-shaped model, on one CUDA GPU.

    python bench/gpu_check.py --out $OUT/gpu_check.json            # one CUDA GPU, about 3-5 min on an H200
    python bench/gpu_check.py --smoke --out /tmp/gpu_check.json    # every phase on CPU, tiny model, < 1 min

Needs only this repository's files and torch, transformers, safetensors and tokenizers: no vLLM, no
network, no installed `sao_core` (the repository root is put on sys.path here). Phases, each timed, with
its peak GPU memory (`torch.cuda.max_memory_allocated`, reset per phase):

1. build: a randomly initialised model of a real shape (`bench/configs/qwen3-1.7b.json`, Qwen3-1.7B's
   config.json; seeded), saved in the engine's dtype with a word-level tokenizer over its ids (no real
   tokenizer is needed: engine and learner work on token ids). The tokenizer's end-of-sequence id lies
   outside the model's output range, so every sequence runs to its full length.
2. engine: `sao_core.rollout.engines.hf.HFEngine` (bf16, KV cache, `max_batch` = sequences) samples 64
   sequences of 1,024 new tokens at temperature 1 from 16-token random prompts; tokens/s over the
   generation (model loading timed apart).
3. learner: one SAO `Updater.step` (critic values, K = 2 critic updates, DIS policy update; float32
   master weights, bf16 autocast, activation checkpointing) on 16 of those sequences cut to 1,024 tokens
   (16,384 tokens, the engine's log-probs as rollout log-probs), single GPU. Before the step the policy's
   log-probs are recomputed (`training.forward.model_logprobs` under the learner's autocast) and compared
   with the engine's: max / mean |engine − learner| on the sampled tokens. A second step gives the
   steady-state time (the first one allocates the optimiser states).
4. learner_fsdp: the same step with policy and critic under FSDP2 (`fully_shard` of every decoder layer
   and the root) in a one-process NCCL group.
5. learner_lora: the learner step with a LoRA policy (peft; `--lora-rank`, default 16, alpha 2 × rank, all
   linear layers) and SAO's full critic: peak memory and step time against `learner`'s (issue 29);
   learner_lora_critic: the same with a LoRA adapter on the critic's body too (`critic_lora_rank`).
6. sft / sft_lora: one supervised step (next-token loss on every token of the learner batch, float32
   master weights, bf16 autocast, activation checkpointing, AdamW over what trains), full and LoRA.
7. push: the LoRA policy of `learner_lora` published the two ways a LoRA run can push it — the adapter alone
   (twice: the first push injects the LoRA layers into the engine, the second only copies weights) and the
   merged full model — each staged, sealed with a manifest, verified as a rollout service verifies it,
   loaded by the HF engine (bf16) and checked with the learner's delivery probe (32 tokens): bytes, seconds
   of each stage, and mean / max |engine − learner| probe log-prob, as full / adapter ratios in one run; then
   the merged weights once more in memory (`memory`: `WeightUpdate` + `HFEngine.update_in_memory`, issue 37)
   with the ratio files / memory.

MFU = model FLOPs of the step / seconds / peak (`--peak-tflops`, default 989: H200 dense bf16). Model FLOPs:
forward FLOPs per token = 2 × non-embedding parameters + 2 × layers × sequence length × query width
(causal attention), plus 2 × vocab × hidden for the output layer on the sampled tokens of the policy;
the step = 3 × policy forward (forward + backward) + (1 + 3K) × critic forward; recomputation from
activation checkpointing is not counted.

A phase that fails is recorded (`errors`, the phase's `error`) and the kit goes on; the JSON is rewritten
after every phase and at the end; the exit code is 1 when a phase failed, 2 without CUDA (and no
--smoke). A time budget (`--budget-s`, default 420 s) is checked before every phase and every step.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time
import traceback
import types
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
for _key, _value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                     "OMP_WAIT_POLICY": "PASSIVE", "TQDM_DISABLE": "1"}.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402

DEFAULT_CONFIG = ROOT / "bench" / "configs" / "qwen3-1.7b.json"
H200_BF16_TFLOPS = 989.0
GB = 2 ** 30
PHASES = ("build", "engine", "learner", "learner_fsdp", "learner_lora", "learner_lora_critic", "sft", "sft_lora",
          "push")
# Config fields that are bookkeeping, not architecture (the kit sets the dtype itself).
_NOT_ARCHITECTURE = ("architectures", "transformers_version", "torch_dtype", "dtype")
# --smoke: the same architecture, tiny.
SMOKE_MODEL = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
               "max_window_layers": 2, "bos_token_id": None, "eos_token_id": None}
# (GPU run, --smoke) defaults of the sizes.
DEFAULTS = {"sequences": (64, 8), "prompt_tokens": (16, 8), "new_tokens": (1024, 32), "learner_sequences": (16, 8),
            "learner_seq_tokens": (1024, 40), "micro_batch_tokens": (16384, 16384), "learner_steps": (2, 2),
            "precision": ("bf16", "float32"), "budget_s": (480.0, 180.0), "lora_rank": (16, 4)}


# ---------------------------------------------------------------------------------------------- model loading
def model_api() -> tuple[types.ModuleType, str]:
    """`sao_core.models` (load_model, load_model_and_tokenizer, load_tokenizer) and where it came from. It
    imports with torch, transformers, safetensors and tokenizers alone (`sao_core.storage` needs boto3 only
    for s3:// URIs)."""
    import sao_core.models as models

    return models, "sao_core.models"


def save_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose ids are the model's: <unk> 0, <t1> ... <t{V-2}>, <pad> V-1, and <eos> V
    (outside the model's output range, never sampled)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(1, vocab_size - 1)}
    vocab.update({"<unk>": 0, "<pad>": vocab_size - 1, "<eos>": vocab_size})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<eos>")
    fast.save_pretrained(str(directory))


def step_flops(shape: dict, tokens: int, action_tokens: int, seq_len: float, critic_updates: int) -> float:
    """Model FLOPs of one SAO learner step (see the module docstring)."""
    body = 2 * shape["non_embedding_params"] + 2 * shape["layers"] * seq_len * shape["q_dim"]
    head = 2 * shape["vocab_size"] * shape["hidden_size"]
    return 3 * (tokens * body + action_tokens * head) + (1 + 3 * critic_updates) * tokens * body


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


# ---------------------------------------------------------------------------------------------------- the kit
class Kit:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.smoke = args.smoke
        self.started = time.monotonic()
        self.device = torch.device("cpu") if self.smoke else torch.device("cuda", 0)
        self.cuda = self.device.type == "cuda"
        self.engine_dtype = "bfloat16" if args.precision == "bf16" else "float32"
        self.workdir = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=args.workdir))
        self.model_dir = self.workdir / "model"
        self.cache_dir = self.workdir / "cache"
        self.models, loader = model_api()
        self.generations: list[tuple[list[int], object]] = []
        self.lora_policy = None     # the trained LoRA policy of learner_lora, pushed by the push phase
        self.shape: dict = {}
        self.pad_id = 0
        self.report: dict = {
            "kit": "gpu_check", "format": 1, "smoke": self.smoke, "ok": False,
            "device": self._device_info(), "python": platform.python_version(),
            "torch_version": torch.__version__, "transformers_version": _version("transformers"),
            "safetensors_version": _version("safetensors"), "tokenizers_version": _version("tokenizers"),
            "model_loader": loader, "config_name": args.config.stem + ("+smoke" if self.smoke else ""),
            "config_path": str(args.config), "model": {}, "precision": args.precision,
            "engine_dtype": self.engine_dtype, "activation_checkpointing": True,
            "peak_tflops": args.peak_tflops,
            "settings": {k: getattr(args, k) for k in DEFAULTS},
            "phases": {name: {"ok": False, "skipped": True, "seconds": None, "tokens": None, "tokens_per_s": None,
                              "peak_gpu_gb": None, "error": None} for name in PHASES},
            "mfu": {"learner": None, "learner_fsdp": None, "learner_lora": None, "learner_lora_critic": None},
            "peft_version": _version("peft"), "ratios": {},
            "mfu_formula": "model FLOPs / s / peak_tflops; per token forward = 2 x non-embedding params + 2 x "
                           "layers x seq_len x q_dim (+ 2 x vocab x hidden on sampled tokens, policy); step = "
                           "3 x policy forward + (1 + 3K) x critic forward; recompute not counted",
            "logp_diff_max": None, "logp_diff_mean": None,
            "logp_diff_source": "engine log-probs vs training.forward.model_logprobs of the learner's policy "
                                "(float32 weights, learner autocast) on the sampled tokens, before the step",
            "batch_source": None, "errors": {}, "total_seconds": None, "budget_s": args.budget_s,
        }
        self.write()

    # -------------------------------------------------------------------------------------------- plumbing
    def _device_info(self) -> dict:
        if not self.cuda:
            return {"type": "cpu", "name": platform.processor() or platform.machine(), "count": 0,
                    "cpu_threads": torch.get_num_threads()}
        props = torch.cuda.get_device_properties(self.device)
        return {"type": "cuda", "name": torch.cuda.get_device_name(self.device), "count": torch.cuda.device_count(),
                "capability": list(torch.cuda.get_device_capability(self.device)),
                "total_memory_gb": round(props.total_memory / GB, 2), "cuda_version": torch.version.cuda,
                "bf16_supported": torch.cuda.is_bf16_supported()}

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def log(self, message: str) -> None:
        print(f"[gpu_check {self.elapsed():6.1f}s] {message}", file=sys.stderr, flush=True)

    def write(self) -> None:
        self.report["total_seconds"] = round(self.elapsed(), 2)
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=2, default=str) + "\n")
        tmp.replace(out)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        gc.collect()
        if self.smoke:
            # What survives a full collection (the imports, the kit) is left out of the next ones: on CPU each
            # collection walked every object of torch and transformers (~0.4 s, twice a phase: half the smoke's
            # CPU). Garbage is still collected at every phase boundary. run() unfreezes at the end.
            gc.freeze()
        if self.cuda:
            torch.cuda.empty_cache()

    def over_budget(self, reserve: float = 0.0) -> bool:
        return self.elapsed() + reserve > self.args.budget_s

    def phase(self, name: str, fn) -> None:
        record = self.report["phases"][name]
        if self.over_budget():
            record.update(skipped=True, error=f"skipped: the time budget of {self.args.budget_s:.0f} s is spent")
            self.report["errors"][name] = record["error"]
            self.log(f"{name}: {record['error']}")
            self.write()
            return
        record["skipped"] = False
        self.log(f"{name}: start")
        self.free()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        began = time.monotonic()
        try:
            fn(record)
            record["ok"] = True
        except Exception as err:  # a failed phase is recorded and the kit goes on
            record["error"] = f"{type(err).__name__}: {err}"
            record["traceback"] = traceback.format_exc()[-4000:]
            self.report["errors"][name] = record["error"]
            self.log(f"{name}: FAILED {record['error']}")
        finally:
            record["wall_seconds"] = round(time.monotonic() - began, 3)
            if self.cuda:
                record["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated(self.device) / GB, 3)
                record["peak_gpu_reserved_gb"] = round(torch.cuda.max_memory_reserved(self.device) / GB, 3)
            self.free()
            self.log(f"{name}: {'ok' if record['ok'] else 'failed'} in {record['wall_seconds']:.1f} s"
                     + (f", tokens/s {record['tokens_per_s']:.0f}" if record.get("tokens_per_s") else "")
                     + (f", peak {record['peak_gpu_gb']:.1f} GB" if record.get("peak_gpu_gb") is not None else ""))
            self.write()

    # ----------------------------------------------------------------------------------------------- phases
    def build(self, record: dict) -> None:
        began = time.monotonic()
        from transformers import AutoConfig, AutoModelForCausalLM

        raw = json.loads(self.args.config.read_text())
        fields = {k: v for k, v in raw.items() if k not in _NOT_ARCHITECTURE}
        if self.smoke:
            fields.update(SMOKE_MODEL)
        config = AutoConfig.for_model(**fields)
        dtype = getattr(torch, self.engine_dtype)
        torch.manual_seed(self.args.seed)
        try:
            with torch.device(self.device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            record["init_device"] = str(self.device)
        except Exception as err:  # some transformers versions refuse a device context: initialise on CPU
            self.log(f"build: initialising on {self.device} failed ({type(err).__name__}: {err}); on CPU")
            torch.manual_seed(self.args.seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            record["init_device"] = "cpu"
        params = {id(p): p.numel() for p in model.parameters()}
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        total = sum(params.values())
        embedding = embed.numel() + (head.numel() if head is not embed else 0)
        self.shape = {"params": total, "non_embedding_params": total - embedding, "layers": config.num_hidden_layers,
                      "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                      "q_dim": config.num_attention_heads * (getattr(config, "head_dim", None)
                                                             or config.hidden_size // config.num_attention_heads),
                      "kv_heads": config.num_key_value_heads, "intermediate_size": config.intermediate_size,
                      "tied_embeddings": head is embed, "model_type": config.model_type,
                      "architecture": type(model).__name__}
        self.report["model"] = self.shape
        model.save_pretrained(str(self.model_dir))
        del model
        save_tokenizer(self.model_dir, config.vocab_size)
        from sao_core import storage  # needs no boto3 for local paths

        storage.seal_checkpoint(self.model_dir, metadata={"kind": "model"})  # loads verify it (its manifest)
        tokenizer = self.models.load_tokenizer(str(self.model_dir), str(self.cache_dir))
        if tokenizer.pad_token_id != config.vocab_size - 1 or tokenizer.eos_token_id != config.vocab_size:
            raise RuntimeError(f"tokenizer ids: pad {tokenizer.pad_token_id}, eos {tokenizer.eos_token_id}")
        self.pad_id = tokenizer.pad_token_id
        record["seconds"] = round(time.monotonic() - began, 3)
        record["model_dir_gb"] = round(sum(f.stat().st_size for f in self.model_dir.iterdir()) / GB, 3)
        self.log(f"build: {self.shape['architecture']} {total / 1e6:.2f}M parameters "
                 f"({self.shape['non_embedding_params'] / 1e6:.2f}M non-embedding), saved {record['model_dir_gb']} GB")

    def engine(self, record: dict) -> None:
        from sao_core.rollout.engines.base import SamplingParams
        from sao_core.rollout.engines.hf import HFEngine

        args = self.args
        vocab = self.shape["vocab_size"]
        gen = torch.Generator().manual_seed(args.seed + 1)
        prompts = [torch.randint(1, vocab - 1, (args.prompt_tokens,), generator=gen).tolist()
                   for _ in range(args.sequences)]
        timeout = max(30.0, args.budget_s - self.elapsed() - (60 if self.smoke else 150))
        timing: dict = {}

        async def go():
            began = time.monotonic()
            engine = HFEngine(str(self.model_dir), str(self.cache_dir), max_batch=args.sequences,
                              device=str(self.device), dtype=self.engine_dtype, seed=args.seed)
            timing["load"] = time.monotonic() - began
            try:
                began = time.monotonic()
                jobs = [engine.generate(p, SamplingParams(max_new_tokens=args.new_tokens, seed=1000 + i))
                        for i, p in enumerate(prompts)]
                gathered = asyncio.ensure_future(asyncio.gather(*jobs))
                while not gathered.done():   # a progress line every 20 s, the time budget enforced
                    left = began + timeout - time.monotonic()
                    if left <= 0:
                        gathered.cancel()
                        raise TimeoutError(f"generation did not finish within {timeout:.0f} s (time budget); "
                                           f"{engine.stats()['tokens_generated']} tokens sampled")
                    await asyncio.wait({gathered}, timeout=min(20.0, left))
                    if not gathered.done():
                        self.log(f"engine: {engine.stats()['tokens_generated']} tokens sampled in "
                                 f"{time.monotonic() - began:.0f} s")
                out = gathered.result()
                timing["generate"] = time.monotonic() - began
                timing["stats"] = engine.stats()
                return out
            finally:
                await engine.close()

        generations = asyncio.run(go())
        tokens = sum(len(g.token_ids) for g in generations)
        seconds = timing["generate"]
        stats = timing["stats"]
        record.update(seconds=round(seconds, 3), load_seconds=round(timing["load"], 3), tokens=tokens,
                      tokens_per_s=tokens / seconds, sequences=len(generations),
                      finish_reasons=dict(Counter(g.finish_reason for g in generations)),
                      engine_steps=stats["steps"], kv_cache=stats["kv_cache"],
                      busy_seconds=round(stats["busy_seconds"], 3), max_batch=args.sequences)
        lengths = {len(g.token_ids) for g in generations}
        if lengths != {args.new_tokens}:
            raise RuntimeError(f"expected every sequence to have {args.new_tokens} new tokens, got lengths {lengths}")
        bad = [lp for g in generations for lp in g.logprobs if not (math.isfinite(lp) and lp <= 1e-4)]
        if bad:
            raise RuntimeError(f"{len(bad)} engine log-probs are not finite log-probabilities (e.g. {bad[0]})")
        self.generations = list(zip(prompts, generations, strict=True))

    def trajectories(self) -> list:
        """The learner batch: the first `learner_sequences` engine sequences cut to `learner_seq_tokens` tokens
        (prompt included; the engine's log-probs and versions on the sampled tokens); random tokens with
        uniform log-probs when the engine phase failed."""
        from sao_core.rollout.trajectory import Trajectory

        args = self.args
        rows = []
        if self.generations:
            self.report["batch_source"] = "engine"
            for prompt, g in self.generations[:args.learner_sequences]:
                keep = max(1, args.learner_seq_tokens - len(prompt))
                sampled, logprobs, versions = g.token_ids[:keep], g.logprobs[:keep], g.versions[:keep]
                rows.append((prompt, sampled, logprobs, versions))
        else:
            self.report["batch_source"] = "random tokens with uniform log-probs (the engine phase failed)"
            vocab = self.shape["vocab_size"]
            gen = torch.Generator().manual_seed(self.args.seed + 2)
            keep = max(1, args.learner_seq_tokens - args.prompt_tokens)
            for _ in range(args.learner_sequences):
                ids = torch.randint(1, vocab - 1, (args.prompt_tokens + keep,), generator=gen).tolist()
                rows.append((ids[:args.prompt_tokens], ids[args.prompt_tokens:], [-math.log(vocab)] * keep,
                             [0] * keep))
        return [Trajectory(id=f"seq{i}", prompt_id=f"p{i}", env="gpu_check", token_ids=prompt + sampled,
                           action_mask=[0] * len(prompt) + [1] * len(sampled),
                           rollout_logprobs=[0.0] * len(prompt) + list(logprobs),
                           versions=[-1] * len(prompt) + list(versions), reward=float(i % 2), num_turns=1,
                           finish_reason="length", metadata={"epoch": 0})
                for i, (prompt, sampled, logprobs, versions) in enumerate(rows)]

    def learner(self, record: dict, fsdp: bool, lora: bool = False, lora_critic: bool = False) -> None:
        import torch.distributed as dist

        from sao_core.learner.batch import collate
        from sao_core.learner.config import RLConfig
        from sao_core.learner.updates import Updater
        from sao_core.models.value import ValueModel
        from sao_core.training.core import autocast, prepare_model
        from sao_core.training.distributed import DistContext, fully_shard_layers
        from sao_core.training.forward import model_logprobs

        args = self.args
        if fsdp:
            self._init_group()
        try:
            ctx = DistContext(rank=0, world_size=1, device=self.device)
            began = time.monotonic()
            policy = self.models.load_model(str(self.model_dir), str(self.cache_dir), dtype="float32")
            critic = ValueModel.from_pretrained(str(self.model_dir))
            if lora:
                policy = self._apply_lora(policy, record)
            if lora_critic:
                from sao_core.training.lora import apply_critic_lora, trainable_parameters

                rank = args.lora_rank
                critic = apply_critic_lora(critic, types.SimpleNamespace(
                    critic_lora_rank=rank, lora_alpha=2.0 * rank, lora_dropout=0.0, lora_target_modules="all-linear"))
                record["critic_trainable_parameters"] = trainable_parameters(critic)[0]
            policy = prepare_model(policy, ctx, gradient_checkpointing=True)
            critic = prepare_model(critic, ctx, gradient_checkpointing=True)
            if fsdp:
                policy, critic = fully_shard_layers(policy), fully_shard_layers(critic)
                record["fsdp2"] = {"world_size": dist.get_world_size(), "backend": dist.get_backend()}
            batch = collate(self.trajectories(), self.pad_id)
            self.sync()
            record["load_seconds"] = round(time.monotonic() - began, 3)
            if not fsdp and not lora and self.report["batch_source"] == "engine":
                self._compare_logprobs(policy, batch, autocast, model_logprobs)
            config = RLConfig(data="unused", output="unused", method="sao", batch_size=len(batch.trajectories),
                              steps=args.learner_steps, precision=args.precision, gradient_checkpointing=True,
                              critic_warmup_steps=0, micro_batch_tokens=args.micro_batch_tokens, seed=args.seed,
                              cache_dir=str(self.cache_dir), lora_rank=args.lora_rank if lora else 0,
                          critic_lora_rank=args.lora_rank if lora_critic else 0)
            config.validate()
            updater = Updater(config, policy, critic, ctx)
            name = ("learner_lora_critic" if lora_critic else "learner_lora" if lora else
                    "learner_fsdp" if fsdp else "learner")
            tokens = int(batch.attention_mask.sum())
            action_tokens = int(batch.action_mask.sum())
            seq_len = tokens / len(batch.trajectories)
            flops = step_flops(self.shape, tokens, action_tokens, seq_len, config.critic_updates)
            record.update(tokens=tokens, action_tokens=action_tokens, sequences=len(batch.trajectories),
                          padded_width=int(batch.input_ids.shape[1]), critic_updates=config.critic_updates,
                          micro_batch_tokens=config.micro_batch_tokens, model_flops_per_step=flops)
            step_seconds = []
            for step in range(args.learner_steps):
                if step and self.over_budget(reserve=30 if fsdp else 90):
                    record["steps_skipped"] = args.learner_steps - step
                    self.log(f"{name}: budget: skipping the remaining steps")
                    break
                self.sync()
                began = time.monotonic()
                metrics, changed = updater.step(batch, step)
                self.sync()
                step_seconds.append(time.monotonic() - began)
                self.log(f"{name}: step {step} {step_seconds[-1]:.2f} s, "
                         f"logp_diff_max {metrics.get('logp_diff_max', float('nan')):.4g}, "
                         f"policy_loss {metrics.get('policy_loss', float('nan')):.4g}, "
                         f"critic_loss {metrics.get('critic_loss', float('nan')):.4g}")
                if step == 0:
                    record["metrics"] = metrics
                    record["policy_changed"] = changed
                    broken = [k for k in ("policy_loss", "critic_loss", "policy_grad_norm", "critic_grad_norm",
                                          "logp_diff_max") if not _finite(metrics.get(k))]
                    if broken or not changed:
                        raise RuntimeError(f"step 0: not finite or missing: {broken}; policy changed: {changed}")
            seconds = step_seconds[-1]
            record.update(seconds=round(seconds, 4), step_seconds=[round(s, 4) for s in step_seconds],
                          first_step_seconds=round(step_seconds[0], 4), tokens_per_s=tokens / seconds,
                          mfu=flops / seconds / (args.peak_tflops * 1e12))
            self.report["mfu"][name] = record["mfu"]
            if lora and not lora_critic:
                self.lora_policy = policy
        finally:
            if fsdp and dist.is_initialized():
                dist.destroy_process_group()

    def _apply_lora(self, model, record: dict):
        from sao_core.training.lora import apply_lora, trainable_parameters

        rank = self.args.lora_rank
        model = apply_lora(model, rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules="all-linear")
        trained, total = trainable_parameters(model)
        record["lora"] = {"rank": rank, "alpha": 2.0 * rank, "target_modules": "all-linear",
                          "trainable_parameters": trained, "parameters": total}
        return model

    def sft(self, record: dict, lora: bool) -> None:
        """One supervised step on the learner batch (every token a target), full or LoRA; the last of
        `learner_steps` steps timed."""
        from sao_core.learner.batch import collate
        from sao_core.objectives.sft import sft_loss
        from sao_core.training.core import autocast, build_optimizer, clip_and_step, prepare_model
        from sao_core.training.distributed import DistContext
        from sao_core.training.forward import model_logprobs

        args = self.args
        ctx = DistContext(rank=0, world_size=1, device=self.device)
        began = time.monotonic()
        model = self.models.load_model(str(self.model_dir), str(self.cache_dir), dtype="float32")
        if lora:
            model = self._apply_lora(model, record)
        model = prepare_model(model, ctx, gradient_checkpointing=True)
        model.train()
        optimizer = build_optimizer(model.parameters(), lr=1e-5, weight_decay=0.0)
        batch = collate(self.trajectories(), self.pad_id).to(self.device)
        mask = batch.attention_mask
        self.sync()
        record["load_seconds"] = round(time.monotonic() - began, 3)
        tokens = int(mask.sum())
        step_seconds, losses = [], []
        for step in range(args.learner_steps):
            if step and self.over_budget(reserve=60):
                record["steps_skipped"] = args.learner_steps - step
                break
            self.sync()
            began = time.monotonic()
            with autocast(args.precision, self.device):
                logp, _ = model_logprobs(model, batch.input_ids, mask, positions=mask)
                loss, _ = sft_loss(logp, mask)
            loss.backward()
            norm = clip_and_step(optimizer, model.parameters(), 1.0)
            self.sync()
            step_seconds.append(time.monotonic() - began)
            losses.append(float(loss.detach()))
            self.log(f"{'sft_lora' if lora else 'sft'}: step {step} {step_seconds[-1]:.2f} s, loss {losses[-1]:.4f}, "
                     f"grad norm {norm:.4g}")
            if not (math.isfinite(losses[-1]) and math.isfinite(norm)):
                raise RuntimeError(f"step {step}: loss {losses[-1]}, grad norm {norm}")
        seconds = step_seconds[-1]
        record.update(seconds=round(seconds, 4), step_seconds=[round(s, 4) for s in step_seconds], tokens=tokens,
                      tokens_per_s=tokens / seconds, losses=losses,
                      optimizer_state_elements=sum(t.numel() for st in optimizer.state.values()
                                                   for t in st.values() if torch.is_tensor(t) and t.dim()))

    async def _push_in_memory(self, policy, engine, version: int, ids: list[int], mine: list[float]) -> dict:
        """The merged policy handed to the engine in memory (`WeightUpdate` + `HFEngine.update_in_memory`: the
        colocated transport of issue 37), timed by stage and delivery-checked like the file pushes."""
        from sao_core.rollout.weights import WeightUpdate
        from sao_core.training.lora import plain_state_dict

        self.sync()
        t0 = time.monotonic()
        state = plain_state_dict(policy, lambda m: m.state_dict())
        t1 = time.monotonic()
        update = WeightUpdate.build(version, state, engine.weight_dtypes())
        await engine.update_in_memory(update)
        self.sync()
        t2 = time.monotonic()
        theirs = await engine.score(ids, 1)
        t3 = time.monotonic()
        diffs = [abs(a - b) for a, b in zip(theirs, mine, strict=True)]
        times = {"merge": t1 - t0, "update": t2 - t1, "probe": t3 - t2}
        self.log(f"push: memory {update.nbytes / 2**20:.1f} MiB in {sum(times.values()):.2f} s "
                 f"({ {k: round(v, 2) for k, v in times.items()} })")
        return {"bytes": update.nbytes, "seconds": {k: round(v, 3) for k, v in times.items()},
                "total_seconds": round(sum(times.values()), 3), "probe_diff_mean": sum(diffs) / len(diffs),
                "probe_diff_max": max(diffs)}

    def push(self, record: dict) -> None:
        """The trained LoRA policy pushed as an adapter (twice) and as the merged full model to a bf16 HF engine,
        each delivery-checked (see the module docstring)."""
        from sao_core import storage
        from sao_core.learner.delivery import learner_logprobs, probe_tokens
        from sao_core.rollout.engines.hf import HFEngine
        from sao_core.training.checkpointing import save_full_model, trainable_state_dict
        from sao_core.training.core import autocast
        from sao_core.training.distributed import DistContext
        from sao_core.training.lora import adapter_state_dict, write_adapter

        if self.lora_policy is None:
            raise RuntimeError("no LoRA policy: the learner_lora phase failed")
        policy, ctx = self.lora_policy, DistContext(rank=0, world_size=1, device=self.device)
        tokenizer = self.models.load_tokenizer(str(self.model_dir), str(self.cache_dir))
        ids = probe_tokens(self.shape["vocab_size"] - 1, 32, self.args.seed)
        mine = learner_logprobs(policy, ids, 1, autocast(self.args.precision, self.device), self.device)

        async def go():
            began = time.monotonic()
            engine = HFEngine(str(self.model_dir), str(self.cache_dir), max_batch=4, device=str(self.device),
                              dtype=self.engine_dtype, seed=self.args.seed)
            record["engine_load_seconds"] = round(time.monotonic() - began, 3)
            try:
                for version, mode in enumerate(("adapter", "adapter_again", "full"), start=1):
                    if self.over_budget(reserve=20):
                        record[mode] = {"skipped": "time budget"}
                        continue
                    staging, uri = self.workdir / f"stage-{mode}", self.workdir / f"weights-v{version}"
                    times = {}
                    self.sync()
                    t0 = time.monotonic()
                    if mode == "full":
                        save_full_model(policy, tokenizer, staging, ctx)
                    else:
                        write_adapter(policy, adapter_state_dict(policy, trainable_state_dict), staging)
                    times["stage"] = time.monotonic() - t0
                    t1 = time.monotonic()
                    storage.publish_checkpoint(staging, str(uri), metadata={"version": version})
                    digest = storage.checkpoint_digest(str(uri))
                    local = storage.fetch_checkpoint(str(uri), self.cache_dir / "weights")   # verifies every file
                    times["publish_verify"] = time.monotonic() - t1
                    t2 = time.monotonic()
                    await engine.load_weights(str(local), version)
                    times["engine_load"] = time.monotonic() - t2
                    t3 = time.monotonic()
                    theirs = await engine.score(ids, 1)
                    times["probe"] = time.monotonic() - t3
                    if mode == "full":   # issue 37: the same merged weights again, in memory (no files)
                        record["memory"] = await self._push_in_memory(policy, engine, version + 1, ids, mine)
                    diffs = [abs(a - b) for a, b in zip(theirs, mine, strict=True)]
                    size = sum(f.stat().st_size for f in Path(uri).iterdir() if f.is_file())
                    record[mode] = {"bytes": size, "digest": digest[:12],
                                    "seconds": {k: round(v, 3) for k, v in times.items()},
                                    "total_seconds": round(sum(times.values()), 3),
                                    "probe_diff_mean": sum(diffs) / len(diffs), "probe_diff_max": max(diffs)}
                    self.log(f"push: {mode} {size / 2**20:.1f} MiB in {sum(times.values()):.2f} s "
                             f"({ {k: round(v, 2) for k, v in times.items()} }), probe |diff| mean "
                             f"{record[mode]['probe_diff_mean']:.4g} max {record[mode]['probe_diff_max']:.4g}")
            finally:
                await engine.close()

        asyncio.run(go())
        memory = record.get("memory", {})
        if "total_seconds" in memory and "total_seconds" in record.get("full", {}):
            self.report["ratios"]["push_seconds_files_over_memory"] = record["full"]["total_seconds"] / \
                memory["total_seconds"]
        full, adapter = record.get("full", {}), record.get("adapter_again", {})
        if "bytes" in full and "bytes" in adapter:
            self.report["ratios"]["push_bytes_full_over_adapter"] = full["bytes"] / adapter["bytes"]
            self.report["ratios"]["push_seconds_full_over_adapter"] = full["total_seconds"] / adapter["total_seconds"]
        record["seconds"] = round(sum(r.get("total_seconds", 0.0) for r in (record.get(m, {}) for m in
                                                                            ("adapter", "adapter_again", "full"))), 3)

    def _ratios(self) -> None:
        """Full / LoRA peak memory and step time, measured side by side in this run."""
        phases, ratios = self.report["phases"], self.report["ratios"]
        for full, lora in (("learner", "learner_lora"), ("sft", "sft_lora"), ("learner_lora", "learner_lora_critic")):
            a, b = phases[full], phases[lora]
            if a["ok"] and b["ok"]:
                if a.get("peak_gpu_gb") and b.get("peak_gpu_gb"):
                    ratios[f"peak_memory_{full}_over_{lora}"] = a["peak_gpu_gb"] / b["peak_gpu_gb"]
                ratios[f"step_seconds_{full}_over_{lora}"] = a["seconds"] / b["seconds"]

    def _compare_logprobs(self, policy, batch, autocast, model_logprobs) -> None:
        """max / mean |engine log-prob − learner log-prob| on the sampled tokens, before any update."""
        policy.eval()
        batch = batch.to(self.device)
        with torch.no_grad(), autocast(self.args.precision, self.device):
            logp, _ = model_logprobs(policy, batch.input_ids, batch.attention_mask, positions=batch.action_mask)
        mask = batch.action_mask.bool()
        diff = (logp.float() - batch.rollout_logprobs.float()).abs()[mask]
        self.report["logp_diff_max"] = float(diff.max())
        self.report["logp_diff_mean"] = float(diff.mean())
        self.report["learner_logp_mean"] = float(logp[mask].mean())
        self.log(f"learner: |engine - learner| log-prob max {self.report['logp_diff_max']:.4g}, "
                 f"mean {self.report['logp_diff_mean']:.4g} over {int(mask.sum())} tokens")
        policy.train()

    def _init_group(self) -> None:
        """A one-process group: NCCL on the GPU, gloo on CPU (--smoke)."""
        import torch.distributed as dist

        if dist.is_initialized():
            return
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          LOCAL_WORLD_SIZE="1")
        if self.cuda:
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if self.cuda else "gloo", rank=0, world_size=1)

    def wanted(self, name: str) -> bool:
        return not self.args.phases or name in self.args.phases

    def run_phase(self, name: str, fn) -> None:
        if self.wanted(name):
            self.phase(name, fn)
        else:
            self.report["phases"][name]["error"] = "skipped: not in --phases"

    def run(self) -> int:
        self.log(f"device {self.report['device']['name']}, torch {torch.__version__}, transformers "
                 f"{self.report['transformers_version']}, loader: {self.report['model_loader']}")
        self.phase("build", self.build)
        if self.report["phases"]["build"]["ok"]:
            if self.args.skip_engine:   # the learner phases then train on random tokens
                self.report["phases"]["engine"]["error"] = "skipped: --skip-engine"
            else:
                self.run_phase("engine", self.engine)
            self.run_phase("learner", lambda r: self.learner(r, fsdp=False))
            self.run_phase("learner_fsdp", lambda r: self.learner(r, fsdp=True))
            self.run_phase("learner_lora", lambda r: self.learner(r, fsdp=False, lora=True))
            self.run_phase("learner_lora_critic", lambda r: self.learner(r, fsdp=False, lora=True, lora_critic=True))
            self.run_phase("sft", lambda r: self.sft(r, lora=False))
            self.run_phase("sft_lora", lambda r: self.sft(r, lora=True))
            self.run_phase("push", self.push)
            self.lora_policy = None
            self._ratios()
        else:
            for name in PHASES[1:]:
                self.report["phases"][name]["error"] = "skipped: the build phase failed"
                self.report["errors"][name] = "skipped: the build phase failed"
        gc.unfreeze()   # back to the collector, so that the interpreter's exit finalises them (see free)
        self.report["ok"] = all(self.report["phases"][name]["ok"] for name in PHASES)
        self.write()
        if not self.args.keep_workdir:
            import shutil

            shutil.rmtree(self.workdir, ignore_errors=True)
        summary = {name: (p["tokens_per_s"], p["peak_gpu_gb"]) for name, p in self.report["phases"].items()}
        self.log(f"done in {self.elapsed():.1f} s, ok={self.report['ok']}: tokens/s and peak GB {summary}, "
                 f"mfu {self.report['mfu']}, logp_diff_max {self.report['logp_diff_max']}, ratios "
                 f"{self.report['ratios']}; wrote {self.args.out}")
        return 0 if self.report["ok"] else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--smoke", action="store_true", help="every phase on CPU with a tiny model (gloo)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a Hugging Face config.json")
    parser.add_argument("--sequences", type=int, help="engine sequences (and max_batch); 64, smoke 8")
    parser.add_argument("--prompt-tokens", type=int, help="random prompt tokens per sequence; 16, smoke 8")
    parser.add_argument("--new-tokens", type=int, help="tokens sampled per sequence; 1024, smoke 32")
    parser.add_argument("--learner-sequences", type=int, help="sequences in the learner batch; 16, smoke 8")
    parser.add_argument("--learner-seq-tokens", type=int, help="learner sequence length, prompt included; 1024")
    parser.add_argument("--micro-batch-tokens", type=int, help="RLConfig.micro_batch_tokens; 16384")
    parser.add_argument("--learner-steps", type=int, help="learner steps per learner phase (the last is timed); 2")
    parser.add_argument("--precision", choices=("bf16", "float32"),
                        help="learner precision, and the engine's dtype; bf16, smoke float32")
    parser.add_argument("--budget-s", type=float, help="time budget in seconds; 480, smoke 180")
    parser.add_argument("--lora-rank", type=int, help="LoRA rank of the learner_lora, sft_lora and push phases; "
                                                      "16, smoke 4")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS,
                        help="peak dense bf16 TFLOPs of the GPU for the MFU (default: H200, 989)")
    parser.add_argument("--skip-engine", action="store_true",
                        help="skip the engine phase (the learner phases train on random tokens)")
    parser.add_argument("--phases", type=lambda v: [x.strip() for x in v.split(",") if x.strip()], default=[],
                        help="comma-separated phases to run after build (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="where the temporary model directory goes (default: TMPDIR)")
    parser.add_argument("--keep-workdir", action="store_true")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.phases) - set(PHASES[1:]))
    if unknown:
        parser.error(f"--phases: unknown {', '.join(unknown)} (phases: {', '.join(PHASES[1:])})")
    for key, (gpu, smoke) in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else gpu)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        message = ("gpu_check: no CUDA device (torch.cuda.is_available() is False; torch "
                   f"{torch.__version__}, CUDA build {torch.version.cuda}); run on a CUDA machine, or pass --smoke "
                   "for the CPU run")
        print(message, file=sys.stderr)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"kit": "gpu_check", "format": 1, "ok": False, "smoke": False,
                                   "errors": {"device": message}}, indent=2) + "\n")
        return 2
    if args.smoke:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    return Kit(args).run()


if __name__ == "__main__":
    sys.exit(main())
